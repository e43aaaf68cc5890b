// The ordered registration of every built-in fusion.
#include "ops/fused/builtin_fusions.h"

#include "ops/fused/backward_activation_bias.h"
#include "ops/fused/backward_add_norm.h"
#include "ops/fused/backward_linear_activation_bias.h"
#include "ops/fused/backward_linear_add.h"
#include "ops/fused/backward_linear_scale.h"
#include "ops/fused/forward_linear_bias_activation.h"
#include "ops/fused/forward_linear_bias_add.h"
#include "ops/fused/forward_linear_scale_add.h"
#include "ops/fused/grouped_mlp.h"

namespace fusible::ops {

void register_builtin_fusions(FusionRegistry& registry) {
  // Joint (forward and backward): ours, the MoE expert MLP.
  registry.add("GroupedMLP_GroupedGEMMGLU", FusionPass::kForwardBackward, fuse_grouped_mlp);
  // Forward: the residual add first (it takes the Bias that BiasActivation would otherwise take).
  registry.add("ForwardLinearBiasAdd", FusionPass::kForward, fuse_forward_linear_bias_add);
  // Ours: the out-of-place add as the GEMM's C input (before BiasActivation takes the Bias).
  registry.add("ForwardLinearBiasAddOutOfPlace", FusionPass::kForward,
               fuse_forward_linear_bias_add_out_of_place);
  registry.add("ForwardLinearBiasActivation", FusionPass::kForward,
               fuse_forward_linear_bias_activation);
  registry.add("ForwardLinearScaleAdd", FusionPass::kForward, fuse_forward_linear_scale_add);
  // Backward: ours (Bias + activation inside the next linear's dgrad) before
  // BackwardActivationBias, which would otherwise take the Bias + activation pair alone.
  registry.add("BackwardLinearAdd", FusionPass::kBackward, fuse_backward_linear_add);
  registry.add("BackwardLinearScale", FusionPass::kBackward, fuse_backward_linear_scale);
  registry.add("BackwardLinearActivationBias", FusionPass::kBackward,
               fuse_backward_linear_activation_bias);
  registry.add("BackwardActivationBias", FusionPass::kBackward, fuse_backward_activation_bias);
  registry.add("BackwardAddRMSNorm", FusionPass::kBackward, fuse_backward_add_rmsnorm);
  // Ours: the LayerNorm twin of BackwardAddRMSNorm.
  registry.add("BackwardAddLayerNorm", FusionPass::kBackward, fuse_backward_add_layernorm);
}

}  // namespace fusible::ops

// GroupedMLP_GroupedGEMMGLU (ours, named in te.ops' GroupedMLP_* style): the MoE expert MLP
// GroupedLinear + ScaledSwiGLU + GroupedLinear as one op, forward and backward. It runs the same
// grouped GEMMs as the unfused plan but does not keep the activation's output (fc2's input) for
// fc2's weight gradient: the activation's backward kernel recomputes it in the pass that computes
// its gradient (scaled_swiglu_bwd_fwd), and fc2's weight gradient runs after that.
#pragma once

#include "ops/basic/activations.h"
#include "ops/basic/grouped_linear.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class GroupedMLP_GroupedGEMMGLU : public FusedOperation {
 public:
  GroupedMLP_GroupedGEMMGLU(std::shared_ptr<GroupedLinear> fc1,
                            std::shared_ptr<ScaledSwiGLU> activation,
                            std::shared_ptr<GroupedLinear> fc2);
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<GroupedLinear> fc1_, fc2_;
  std::shared_ptr<ScaledSwiGLU> activation_;
};

/// GroupedLinear, ScaledSwiGLU (no interleaving), GroupedLinear with matching group counts and
/// fc1.out_features == 2 * fc2.in_features; declines when only part of the window runs backward.
OpList fuse_grouped_mlp(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

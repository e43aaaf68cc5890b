// ForwardLinearBiasActivation (te.ops' name): BasicLinear + Bias (+ GELU or ReLU) forward as one
// GEMM with the bias, and the activation, in its epilogue; the pre-activation is what the
// activation's backward uses (te.ops leaves the activation unimplemented). Forward-only.
#pragma once

#include "ops/basic/activations.h"
#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class ForwardLinearBiasActivation : public FusedOperation {
 public:
  /// activation: null, or a GELU or ReLU op.
  ForwardLinearBiasActivation(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
                              std::shared_ptr<ElementwiseActivation> activation = nullptr);
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<Bias> bias_;
  std::shared_ptr<ElementwiseActivation> activation_;
};

/// BasicLinear, then a Bias of its out_features in the weight's dtype, then (optionally) GELU or
/// ReLU.
OpList fuse_forward_linear_bias_activation(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

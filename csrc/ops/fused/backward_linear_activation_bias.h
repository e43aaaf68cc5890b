// BackwardLinearActivationBias (ours; beyond te.ops, in its naming style): Bias + GELU or ReLU +
// BasicLinear backward: the linear's dgrad GEMM, then the activation's gradient and the bias
// gradient in one pass in place on its output (kernels::linear_dgrad_act_bias). Backward-only.
#pragma once

#include "ops/basic/activations.h"
#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class BackwardLinearActivationBias : public FusedOperation {
 public:
  BackwardLinearActivationBias(std::shared_ptr<Bias> bias,
                               std::shared_ptr<ElementwiseActivation> activation,
                               std::shared_ptr<BasicLinear> linear);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::string kind_;
};

/// Bias, GELU or ReLU, BasicLinear, all running backward.
OpList fuse_backward_linear_activation_bias(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

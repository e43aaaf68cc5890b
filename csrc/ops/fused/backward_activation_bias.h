// BackwardActivationBias (te.ops' name): Bias + GELU or ReLU backward as one pass that computes the
// activation's gradient and reduces it into the bias gradient. te.ops fuses only under an FP8
// backward recipe (its kernel writes a quantized gradient); ours gains without one, so it fuses
// whenever both backwards run. Backward-only.
#pragma once

#include "ops/basic/activations.h"
#include "ops/basic/bias.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class BackwardActivationBias : public FusedOperation {
 public:
  BackwardActivationBias(std::shared_ptr<Bias> bias,
                         std::shared_ptr<ElementwiseActivation> activation);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::string kind_;
};

/// Bias, then GELU or ReLU, both running backward.
OpList fuse_backward_activation_bias(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

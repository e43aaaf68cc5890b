// ForwardLinearBiasActivation (te.ops' name): BasicLinear + Bias forward as one GEMM with the bias
// added in its epilogue (one rounding instead of two). Forward-only; the backward runs unfused.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/fusible_operation.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class ForwardLinearBiasActivation : public FusedOperation {
 public:
  ForwardLinearBiasActivation(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias);
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<Bias> bias_;
};

/// The fusion function: replaces each BasicLinear directly followed by a Bias of the same dtype.
OpList fuse_forward_linear_bias_activation(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

// Bias: y = x + b over the last dim.
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// Parameter `bias` [size], initialized to zeros.
class Bias : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  Bias(int64_t size, std::optional<c10::Device> device = std::nullopt,
       std::optional<at::ScalarType> dtype = std::nullopt);
  int64_t size() const { return size_; }
  /// The registered bias (a call computes with the call's own, OperationContext::params).
  const at::Tensor& bias() const { return *parameters_.find("bias"); }
  void reset_parameters() override;
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  /// Fills ctx as the forward does and returns the bias in the compute dtype.
  at::Tensor prepare_forward(OperationContext& ctx, const ForwardArgs& args);
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  int64_t size_;
};

}  // namespace fusible::ops

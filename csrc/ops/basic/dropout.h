// Dropout: zeroes elements with probability p in training mode (scaling the rest by 1/(1-p)),
// identity in eval mode.
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

class Dropout : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit Dropout(double p);
  double p() const { return p_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  double p_;
};

}  // namespace fusible::ops

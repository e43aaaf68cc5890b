// Parameter-free ops that only move or scale data: Identity, Reshape, ConstantScale.
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// y = x. Saves nothing.
class Identity : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  Identity() : BasicOperation("Identity") {}
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
};

/// y = x.reshape(shape) (one dim may be -1); the backward reshapes to the input's shape.
class Reshape : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit Reshape(std::vector<int64_t> shape);
  const std::vector<int64_t>& shape() const { return shape_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::vector<int64_t> shape_;
};

/// y = scale * x. Saves nothing.
class ConstantScale : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ConstantScale(double scale) : BasicOperation("ConstantScale"), scale_(scale) {}
  double scale() const { return scale_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  double scale_;
};

}  // namespace fusible::ops

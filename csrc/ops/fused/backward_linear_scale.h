// BackwardLinearScale (te.ops' name): BasicLinear + ConstantScale backward as the dgrad and wgrad
// GEMMs with alpha = scale (no scaled copy of the gradient). Backward-only.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/simple_ops.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class BackwardLinearScale : public FusedOperation {
 public:
  BackwardLinearScale(std::shared_ptr<BasicLinear> linear, std::shared_ptr<ConstantScale> scale);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  double scale_;
};

/// BasicLinear, then ConstantScale, both running backward.
OpList fuse_backward_linear_scale(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

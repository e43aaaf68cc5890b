// BackwardLinearAdd (te.ops' name): MakeExtraOutput(in_place=True) + BasicLinear backward as one
// dgrad GEMM that adds the extra output's gradient in its epilogue (C = that gradient, beta = 1,
// written to a new tensor: the incoming gradient may be shared). Backward-only.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/extra_io.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class BackwardLinearAdd : public FusedOperation {
 public:
  BackwardLinearAdd(std::shared_ptr<MakeExtraOutput> make, std::shared_ptr<BasicLinear> linear);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
};

/// MakeExtraOutput(in_place=True), then BasicLinear, both running backward.
OpList fuse_backward_linear_add(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

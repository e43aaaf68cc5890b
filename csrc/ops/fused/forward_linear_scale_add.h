// ForwardLinearScaleAdd (te.ops' name): BasicLinear + ConstantScale + AddExtraInput(in_place=True)
// forward as one GEMM with alpha = scale accumulating into the extra tensor. Forward-only.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/extra_io.h"
#include "ops/basic/simple_ops.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class ForwardLinearScaleAdd : public FusedOperation {
 public:
  ForwardLinearScaleAdd(std::shared_ptr<BasicLinear> linear, std::shared_ptr<ConstantScale> scale,
                        std::shared_ptr<AddExtraInput> add);
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<ConstantScale> scale_;
  std::shared_ptr<AddExtraInput> add_;
};

/// BasicLinear, ConstantScale, AddExtraInput(in_place=True).
OpList fuse_forward_linear_scale_add(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

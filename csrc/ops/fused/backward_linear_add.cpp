// BackwardLinearAdd.
#include "ops/fused/backward_linear_add.h"

#include "kernels/ops.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardLinearAdd::BackwardLinearAdd(std::shared_ptr<MakeExtraOutput> make,
                                     std::shared_ptr<BasicLinear> linear)
    : FusedOperation("BackwardLinearAdd", {std::move(make), std::move(linear)}) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardLinearAdd::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                 const at::Tensor& grad_output,
                                                 const TensorLists& grad_extra_outputs) {
  const auto& ctx = *ctxs.at(1);
  const auto& x = ctx.saved_tensors.at(0);  // saved when the weight needs a gradient
  const auto& w = ctx.saved_tensors.at(1);  // saved when the input needs a gradient
  const auto dy = cast_to(grad_output, ctx.compute_dtype);
  const auto& dextra = grad_extra_outputs.at(0).at(0);
  at::Tensor dx = dextra;
  if (w.defined()) {
    dx = dextra.defined()
             ? kernels::linear_dgrad_add(dy, w, cast_to(dextra, ctx.compute_dtype), 1.0)
             : kernels::linear_dgrad(dy, w);
  }
  at::Tensor dw;
  if (x.defined()) dw = kernels::linear_wgrad(dy, x);
  return {dx, {{}, {dw}}, {{}, {}}};
}

OpList fuse_backward_linear_add(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto make = op_at<MakeExtraOutput>(list, i);
    auto linear = op_at<BasicLinear>(list, i + 1);
    if (!make || !linear || !make->in_place() || !fctx.runs_backward(*make)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardLinearAdd>(make, linear), 2};
  });
}

}  // namespace fusible::ops

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
  if (w.defined() && !dextra.defined()) {
    dx = kernels::linear_dgrad(dy, w);
  } else if (w.defined() && dextra.scalar_type() == ctx.compute_dtype &&
             ctx.input_dtype == ctx.compute_dtype) {
    dx = kernels::linear_dgrad_add(dy, w, dextra, 1.0);  // the add in the GEMM's epilogue
  } else if (w.defined()) {
    // Mixed dtypes (autocast): add in the input's dtype, as MakeExtraOutput would.
    dx = kernels::add_fwd(cast_to(kernels::linear_dgrad(dy, w), ctx.input_dtype), dextra);
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

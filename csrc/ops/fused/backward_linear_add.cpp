// BackwardLinearAdd.
#include "ops/fused/backward_linear_add.h"

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardLinearAdd::BackwardLinearAdd(std::shared_ptr<MakeExtraOutput> make,
                                     std::shared_ptr<BasicLinear> linear)
    : FusedOperation("BackwardLinearAdd", {std::move(make), linear}), linear_(std::move(linear)) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardLinearAdd::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                 const at::Tensor& grad_output,
                                                 const TensorLists& grad_extra_outputs) {
  auto& ctx = *ctxs.at(1);
  const auto& dextra = grad_extra_outputs.at(0).at(0);
  auto [dx, dw] = linear_->backward_gemms(
      ctx, cast_to(grad_output, ctx.compute_dtype), 1.0,
      [&](const GemmOperand& dy, const GemmOperand& w) {
        if (!dextra.defined()) return gemms::dgrad(dy, w);
        if (dextra.scalar_type() == ctx.compute_dtype && ctx.input_dtype == ctx.compute_dtype) {
          return gemms::dgrad_add(dy, w, dextra);  // the add in the GEMM's epilogue
        }
        // Mixed dtypes (autocast): add in the input's dtype, as MakeExtraOutput would.
        return kernels::add_fwd(cast_to(gemms::dgrad(dy, w), ctx.input_dtype), dextra);
      });
  if (!dx.defined()) dx = dextra;  // the input needs no gradient: only the extra output's
  return {dx, {{}, {dw}}, {{}, {}}};
}

OpList fuse_backward_linear_add(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto make = op_at<MakeExtraOutput>(list, i);
    auto linear = local_linear_at(list, i + 1);
    if (!make || !linear || !make->in_place() || !fctx.runs_backward(*make)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardLinearAdd>(make, linear), 2};
  });
}

}  // namespace fusible::ops

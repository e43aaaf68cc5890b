// BackwardLinearScale.
#include "ops/fused/backward_linear_scale.h"

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardLinearScale::BackwardLinearScale(std::shared_ptr<BasicLinear> linear,
                                         std::shared_ptr<ConstantScale> scale)
    : FusedOperation("BackwardLinearScale", {linear, scale}),
      linear_(std::move(linear)),
      scale_(scale->scale()) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardLinearScale::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                   const at::Tensor& grad_output,
                                                   const TensorLists&) {
  auto& ctx = *ctxs.at(0);
  // Under FP8 the cast sees the linear's own gradient, scale applied (as unfused); else the scale
  // rides on the GEMMs' alpha.
  const bool fp8 = ctx.fp8.on();
  const double alpha = fp8 ? 1.0 : scale_;
  auto dy = cast_to(grad_output, ctx.compute_dtype);
  if (fp8) dy = dy * scale_;
  auto [dx, dw] = linear_->backward_gemms(
      ctx, dy, alpha,
      [&](const GemmOperand& g, const GemmOperand& w) { return gemms::dgrad(g, w, alpha); });
  return {dx, {{dw}, {}}, {{}, {}}};
}

OpList fuse_backward_linear_scale(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto linear = local_linear_at(list, i);
    auto scale = op_at<ConstantScale>(list, i + 1);
    if (!linear || !scale || !fctx.runs_backward(*linear)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardLinearScale>(linear, scale), 2};
  });
}

}  // namespace fusible::ops

// BackwardAddRMSNorm.
#include "ops/fused/backward_add_rmsnorm.h"

#include "kernels/ops.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardAddRMSNorm::BackwardAddRMSNorm(std::shared_ptr<MakeExtraOutput> make,
                                       std::shared_ptr<RMSNorm> norm)
    : FusedOperation("BackwardAddRMSNorm", {make, norm}), norm_(std::move(norm)) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardAddRMSNorm::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                  const at::Tensor& grad_output,
                                                  const TensorLists& grad_extra_outputs) {
  auto& ctx = *ctxs.at(1);
  const auto& dextra = grad_extra_outputs.at(0).at(0);
  if (!dextra.defined() || dextra.scalar_type() != ctx.compute_dtype ||
      ctx.input_dtype != ctx.compute_dtype) {
    // Nothing to add, or mixed dtypes (autocast): the norm's own backward, then the add in the
    // input's dtype, as MakeExtraOutput would.
    auto [dx, dparams] = norm_->op_backward(ctx, grad_output);
    if (dextra.defined()) dx = kernels::add_fwd(cast_to(dx, ctx.input_dtype), dextra);
    return {dx, {{}, std::move(dparams)}, {{}, {}}};
  }
  const auto& s = ctx.saved_tensors;
  auto [dx, dw] = kernels::rmsnorm_bwd_add(cast_to(grad_output, ctx.compute_dtype), s.at(0),
                                           s.at(1), s.at(2), norm_->zero_centered_gamma(), dextra);
  if (!ctx.param_requires_grad.at(0)) dw = at::Tensor();
  return {dx, {{}, {dw}}, {{}, {}}};
}

OpList fuse_backward_add_rmsnorm(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto make = op_at<MakeExtraOutput>(list, i);
    auto norm = op_at<RMSNorm>(list, i + 1);
    if (!make || !norm || make->in_place() || !fctx.runs_backward(*make)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardAddRMSNorm>(make, norm), 2};
  });
}

}  // namespace fusible::ops

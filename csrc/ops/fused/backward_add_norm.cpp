// BackwardAddRMSNorm and BackwardAddLayerNorm.
#include "ops/fused/backward_add_norm.h"

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {
namespace {

// The norm's backward adds dextra itself when dextra is in the dtype of the x it kept: the
// compute dtype, or autocast's float32 residual stream beside a 16-bit one (norm_input).
bool adds_in_kernel(const OperationContext& ctx, const at::Tensor& dextra) {
  return dextra.defined() && dextra.scalar_type() == ctx.saved_tensors.at(0).scalar_type();
}

// Nothing to add, or other dtypes: the norm's own backward, then the add in the extra output's
// dtype (the norm's input), as MakeExtraOutput would.
BackwardResult norm_backward_then_add(BasicOperation& norm, OperationContext& ctx,
                                      const at::Tensor& dy, const at::Tensor& dextra) {
  auto [dx, dparams] = norm.op_backward(ctx, dy);
  if (dextra.defined()) dx = kernels::add_fwd(cast_to(dx, dextra.scalar_type()), dextra);
  return {dx, {{}, std::move(dparams)}, {{}, {}}};
}

at::Tensor if_required(const OperationContext& ctx, size_t i, at::Tensor grad) {
  return ctx.param_requires_grad.at(i) ? std::move(grad) : at::Tensor();
}

// MakeExtraOutput(in_place=False) then a Norm, both running backward.
template <typename Norm, typename Fused>
OpList fuse_make_then_norm(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto make = op_at<MakeExtraOutput>(list, i);
    auto norm = op_at<Norm>(list, i + 1);
    if (!make || !norm || make->in_place() || !fctx.runs_backward(*make)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{std::make_shared<Fused>(make, norm),
                                                                2};
  });
}

}  // namespace

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
  if (!adds_in_kernel(ctx, dextra)) return norm_backward_then_add(*norm_, ctx, grad_output, dextra);
  const auto& s = ctx.saved_tensors;
  auto [dx, dw] = kernels::rmsnorm_bwd_add(cast_to(grad_output, ctx.compute_dtype), s.at(0),
                                           s.at(1), s.at(2), norm_->zero_centered_gamma(), dextra);
  return {dx, {{}, {if_required(ctx, 0, std::move(dw))}}, {{}, {}}};
}

BackwardAddLayerNorm::BackwardAddLayerNorm(std::shared_ptr<MakeExtraOutput> make,
                                           std::shared_ptr<LayerNorm> norm)
    : FusedOperation("BackwardAddLayerNorm", {make, norm}), norm_(std::move(norm)) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardAddLayerNorm::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                    const at::Tensor& grad_output,
                                                    const TensorLists& grad_extra_outputs) {
  auto& ctx = *ctxs.at(1);
  const auto& dextra = grad_extra_outputs.at(0).at(0);
  if (!adds_in_kernel(ctx, dextra)) return norm_backward_then_add(*norm_, ctx, grad_output, dextra);
  const auto& s = ctx.saved_tensors;
  auto [dx, dw, db] =
      kernels::layernorm_bwd_add(cast_to(grad_output, ctx.compute_dtype), s.at(0), s.at(1), s.at(2),
                                 s.at(3), norm_->zero_centered_gamma(), dextra);
  return {
      dx, {{}, {if_required(ctx, 0, std::move(dw)), if_required(ctx, 1, std::move(db))}}, {{}, {}}};
}

OpList fuse_backward_add_rmsnorm(OpList ops, const FusionContext& fctx) {
  return fuse_make_then_norm<RMSNorm, BackwardAddRMSNorm>(std::move(ops), fctx);
}

OpList fuse_backward_add_layernorm(OpList ops, const FusionContext& fctx) {
  return fuse_make_then_norm<LayerNorm, BackwardAddLayerNorm>(std::move(ops), fctx);
}

}  // namespace fusible::ops

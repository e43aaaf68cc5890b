// Activation ops through the fusible::activation_* / glu_* / *swiglu_* / *situglu_* kernels.
#include "ops/basic/activations.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tanh.h>

#include <cmath>
#include <limits>

#include "common/checks.h"
#include "kernels/activation/activation.h"
#include "kernels/dispatch.h"

namespace fusible::ops {
namespace {

// Checks the input and returns the dtype to compute in (autocast's, else the input's).
at::ScalarType activation_dtype(const char* op, const at::Tensor& x, const ForwardArgs& args) {
  FUSIBLE_CHECK_FLOATING(op, "input", x);
  return args.autocast_dtype.value_or(x.scalar_type());
}

void check_even_last_dim(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op,
              ": expected input with an even last dim (it is split in halves), got shape ",
              shape_str(x));
}

}  // namespace

void QuantizedInputCache::save_input(OperationContext& ctx, const at::Tensor& x) const {
  if (!on_) {
    ctx.save_for_backward({x});
    return;
  }
  auto [data, unused, scale_inv] = kernels::fp8_cast(x, "e4m3", 0.0, false);
  ctx.save_for_backward({std::move(data), std::move(scale_inv)});
}

at::Tensor QuantizedInputCache::saved_input(const OperationContext& ctx) {
  const auto& s = ctx.saved_tensors;
  if (s.size() == 1) return s.at(0);
  return (s.at(0).to(at::kFloat) * s.at(1)).to(ctx.compute_dtype);
}

void ElementwiseActivation::fill_context(OperationContext& ctx, const at::Tensor& x,
                                         const at::Tensor& y, const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype(type_name().c_str(), saves_output() ? y : x, args);
  if (ctx.requires_grad) save_input(ctx, saves_output() ? y : x);
}

at::Tensor ElementwiseActivation::defer_output(OperationContext& ctx, const at::Tensor& x) const {
  // One NaN broadcast to the output's shape: no memory, and NaN to any reader that skipped the
  // resolution (DeferredActivation).
  auto stand_in =
      at::full({1}, std::numeric_limits<double>::quiet_NaN(), x.options()).expand(x.sizes());
  ctx.output_act = {stand_in, x, kind_};
  return stand_in;
}

at::Tensor ElementwiseActivation::op_forward(OperationContext& ctx, const at::Tensor& x,
                                             const ForwardArgs& args) {
  const auto xc = cast_to(x, activation_dtype(type_name().c_str(), x, args));
  if (defers(ctx)) {  // the next op casts act(xc) to FP8 from xc
    fill_context(ctx, xc, xc, args);
    return defer_output(ctx, xc);
  }
  auto y = kernels::activation_fwd(xc, kind_);
  fill_context(ctx, xc, y, args);
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> ElementwiseActivation::op_backward(
    OperationContext& ctx, const at::Tensor& dy) {
  // For ReLU the saved tensor is the output: relu_bwd's [saved > 0] is the same mask.
  return {kernels::activation_bwd(cast_to(dy, ctx.compute_dtype), saved_input(ctx), kind_), {}};
}

GluLayout::GluLayout(int64_t interleave_size) : k_(interleave_size) {
  TORCH_CHECK_VALUE(k_ >= 0, "glu_interleave_size: expected a positive size or None, got ", k_);
}

at::Tensor GluLayout::to_halves(const char* op, const at::Tensor& x) const {
  check_even_last_dim(op, x);
  if (k_ == 0 || x.numel() == 0) return x;
  TORCH_CHECK(x.size(-1) % (2 * k_) == 0, op, ": glu_interleave_size=", k_,
              " expects the last dim to be a multiple of ", 2 * k_, ", got shape ", shape_str(x));
  const int64_t blocks = x.size(-1) / (2 * k_);
  return x.reshape({x.numel() / x.size(-1), blocks, 2, k_}).transpose(1, 2).reshape(x.sizes());
}

at::Tensor GluLayout::from_halves(const at::Tensor& dx) const {
  if (k_ == 0 || dx.numel() == 0) return dx;
  const int64_t blocks = dx.size(-1) / (2 * k_);
  return dx.reshape({dx.numel() / dx.size(-1), 2, blocks, k_}).transpose(1, 2).reshape(dx.sizes());
}

at::Tensor GatedActivation::op_forward(OperationContext& ctx, const at::Tensor& x,
                                       const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype(type_name().c_str(), x, args);
  const auto xc = layout_.to_halves(type_name().c_str(), cast_to(x, ctx.compute_dtype));
  if (ctx.requires_grad) save_input(ctx, xc);
  return kernels::glu_fwd(xc, kind_);
}

std::pair<at::Tensor, std::vector<at::Tensor>> GatedActivation::op_backward(OperationContext& ctx,
                                                                            const at::Tensor& dy) {
  return {layout_.from_halves(
              kernels::glu_bwd(cast_to(dy, ctx.compute_dtype), saved_input(ctx), kind_)),
          {}};
}

at::Tensor ParamGatedActivation::op_forward(OperationContext& ctx, const at::Tensor& x,
                                            const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype(type_name().c_str(), x, args);
  const auto xc = layout_.to_halves(type_name().c_str(), cast_to(x, ctx.compute_dtype));
  if (ctx.requires_grad) save_input(ctx, xc);
  return gate_fwd(xc);
}

std::pair<at::Tensor, std::vector<at::Tensor>> ParamGatedActivation::op_backward(
    OperationContext& ctx, const at::Tensor& dy) {
  return {layout_.from_halves(gate_bwd(cast_to(dy, ctx.compute_dtype), saved_input(ctx))), {}};
}

ClampedSwiGLU::ClampedSwiGLU(double limit, double alpha, double offset, int64_t interleave_size)
    : ParamGatedActivation("ClampedSwiGLU", interleave_size),
      limit_(limit),
      alpha_(alpha),
      offset_(offset) {
  kernels::reference::check_clamped_params("ClampedSwiGLU", limit, alpha, offset);
}

at::Tensor ClampedSwiGLU::gate_fwd(const at::Tensor& x) const {
  return kernels::clamped_swiglu_fwd(x, limit_, alpha_, offset_);
}

at::Tensor ClampedSwiGLU::gate_bwd(const at::Tensor& dy, const at::Tensor& x) const {
  return kernels::clamped_swiglu_bwd(dy, x, limit_, alpha_, offset_);
}

SiTUGLU::SiTUGLU(double beta1, double beta2, int64_t interleave_size)
    : ParamGatedActivation("SiTUGLU", interleave_size), beta1_(beta1), beta2_(beta2) {
  kernels::reference::check_situ_params("SiTUGLU", beta1, beta2);
}

at::Tensor SiTUGLU::gate_fwd(const at::Tensor& x) const {
  return kernels::situglu_fwd(x, beta1_, beta2_);
}

at::Tensor SiTUGLU::gate_bwd(const at::Tensor& dy, const at::Tensor& x) const {
  return kernels::situglu_bwd(dy, x, beta1_, beta2_);
}

at::Tensor RowScaledActivation::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                              const at::Tensor& input,
                                              const TensorLists& extra_inputs, TensorLists&,
                                              const ForwardArgs& args) {
  const std::string name = type_name();
  const char* op = name.c_str();
  auto& ctx = *ctxs.at(0);
  ctx.compute_dtype = activation_dtype(op, input, args);
  const auto& scales = extra_inputs.at(0).at(0);
  FUSIBLE_CHECK_FLOATING(op, "scales", scales);
  FUSIBLE_CHECK_MIN_DIM(op, "input", input, 1);
  TORCH_CHECK(scales.sizes().equals(input.sizes().slice(0, input.dim() - 1)), op,
              ": expected scales of shape ", input.sizes().slice(0, input.dim() - 1),
              " (the input's shape without the last dim), got ", scales.sizes());
  auto xc = cast_to(input, ctx.compute_dtype);
  if (gated_) xc = layout_.to_halves(op, xc);
  if (ctx.requires_grad) ctx.save_for_backward({xc, scales});
  return scaled_fwd(xc, scales);
}

BackwardResult RowScaledActivation::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                   const at::Tensor& grad_output,
                                                   const TensorLists&) {
  auto& ctx = *ctxs.at(0);
  const auto& s = ctx.saved_tensors;
  auto [dx, dscales] = scaled_bwd(cast_to(grad_output, ctx.compute_dtype), s.at(0), s.at(1));
  const bool scales_need_grad =
      !ctx.extra_input_requires_grad.empty() && ctx.extra_input_requires_grad[0];
  return {
      gated_ ? layout_.from_halves(dx) : dx, {{}}, {{scales_need_grad ? dscales : at::Tensor()}}};
}

at::Tensor ScaledSwiGLU::scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const {
  return kernels::scaled_swiglu_fwd(x, scales);
}

std::tuple<at::Tensor, at::Tensor> ScaledSwiGLU::scaled_bwd(const at::Tensor& dy,
                                                            const at::Tensor& x,
                                                            const at::Tensor& scales) const {
  return kernels::scaled_swiglu_bwd(dy, x, scales);
}

ScaledSiTUGLU::ScaledSiTUGLU(double beta1, double beta2, int64_t interleave_size)
    : RowScaledActivation("ScaledSiTUGLU", true, interleave_size), beta1_(beta1), beta2_(beta2) {
  kernels::reference::check_situ_params("ScaledSiTUGLU", beta1, beta2);
}

at::Tensor ScaledSiTUGLU::scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const {
  return kernels::scaled_situglu_fwd(x, scales, beta1_, beta2_);
}

std::tuple<at::Tensor, at::Tensor> ScaledSiTUGLU::scaled_bwd(const at::Tensor& dy,
                                                             const at::Tensor& x,
                                                             const at::Tensor& scales) const {
  return kernels::scaled_situglu_bwd(dy, x, scales, beta1_, beta2_);
}

ScaledClampedQGeGLU::ScaledClampedQGeGLU(double limit, double alpha, double offset,
                                         int64_t interleave_size)
    : RowScaledActivation("ScaledClampedQGeGLU", true, interleave_size),
      limit_(limit),
      alpha_(alpha),
      offset_(offset) {
  kernels::reference::check_clamped_params("ScaledClampedQGeGLU", limit, alpha, offset);
}

at::Tensor ScaledClampedQGeGLU::scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const {
  return kernels::scaled_clamped_swiglu_fwd(x, scales, limit_, alpha_, offset_);
}

std::tuple<at::Tensor, at::Tensor> ScaledClampedQGeGLU::scaled_bwd(const at::Tensor& dy,
                                                                   const at::Tensor& x,
                                                                   const at::Tensor& scales) const {
  return kernels::scaled_clamped_swiglu_bwd(dy, x, scales, limit_, alpha_, offset_);
}

// ATen in the accumulation dtype (one rounding per output): y = s * relu(x)^2,
// dx = dy * s * 2 relu(x), dscales = sum of dy * relu(x)^2.
at::Tensor ScaledSReLU::scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  const auto r = x.to(acc).clamp_min(0);
  return (r * r * scales.to(acc).unsqueeze(-1)).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> ScaledSReLU::scaled_bwd(const at::Tensor& dy,
                                                           const at::Tensor& x,
                                                           const at::Tensor& scales) const {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  const auto dyf = dy.to(acc);
  const auto r = x.to(acc).clamp_min(0);
  auto dx = (dyf * scales.to(acc).unsqueeze(-1) * 2 * r).to(x.scalar_type());
  return {dx, (dyf * r * r).sum(-1).to(scales.scalar_type())};
}

ScaledTanhSReLU::ScaledTanhSReLU(double tanh_clamp_scale)
    : RowScaledActivation("ScaledTanhSReLU", false, 0), c_(tanh_clamp_scale) {
  TORCH_CHECK_VALUE(std::isfinite(c_) && c_ > 0,
                    "ScaledTanhSReLU: expected a finite tanh_clamp_scale > 0, got ", c_);
}

// ATen in the accumulation dtype, as ScaledSReLU: g = (c t)^2 with t = tanh(relu(x) / c);
// dg/dx = 2 c t (1 - t^2) where x > 0.
at::Tensor ScaledTanhSReLU::scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  const auto ct = c_ * at::tanh(x.to(acc).clamp_min(0) / c_);
  return (ct * ct * scales.to(acc).unsqueeze(-1)).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> ScaledTanhSReLU::scaled_bwd(const at::Tensor& dy,
                                                               const at::Tensor& x,
                                                               const at::Tensor& scales) const {
  const auto acc = at::promote_types(x.scalar_type(), at::kFloat);
  const auto dyf = dy.to(acc);
  const auto t = at::tanh(x.to(acc).clamp_min(0) / c_);
  const auto dg = 2 * c_ * t * (1 - t * t);  // zero where x <= 0 (t = 0 there)
  auto dx = (dyf * scales.to(acc).unsqueeze(-1) * dg).to(x.scalar_type());
  return {dx, (dyf * (c_ * c_) * t * t).sum(-1).to(scales.scalar_type())};
}

}  // namespace fusible::ops

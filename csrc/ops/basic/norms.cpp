// LayerNorm, RMSNorm and L2Normalization through the fusible norm kernels.
#include "ops/basic/norms.h"

#include <ATen/ops/empty.h>

#include <cmath>
#include <tuple>

#include "common/checks.h"
#include "kernels/dispatch.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {
namespace {

void check_normalized_shape(const char* op, const std::vector<int64_t>& shape) {
  TORCH_CHECK_VALUE(!shape.empty(), op, ": expected a non-empty normalized_shape");
  for (auto s : shape) {
    TORCH_CHECK_VALUE(s > 0, op, ": expected positive sizes in normalized_shape, got ", s);
  }
}

void check_eps(const char* op, double eps) {
  // A negative or NaN eps makes rsqrt's argument negative for small variances: NaN or garbage.
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), op, ": expected eps >= 0 and finite, got ",
                    eps);
}

void check_trailing_dims(const char* op, const at::Tensor& x, const std::vector<int64_t>& shape) {
  const auto nd = static_cast<int64_t>(shape.size());
  TORCH_CHECK(x.dim() >= nd && x.sizes().slice(x.dim() - nd).equals(shape), op,
              ": expected input's trailing dims to be ", c10::IntArrayRef(shape),
              ", got input shape ", shape_str(x));
}

// x as LayerNorm / RMSNorm hand it to their kernels: a float32 x beside a 16-bit compute dtype
// (autocast's float32 residual stream) as it is, since the kernels round it on load as a cast
// would and return its gradient in float32, rounded once; any other dtype converted first. The
// backward keeps this tensor: the float32 input itself, as eager's autocast norms keep it.
at::Tensor norm_input(const at::Tensor& x, at::ScalarType compute) {
  return kernels::norm_reads_as_is(x.scalar_type(), compute) ? x : cast_to(x, compute);
}

}  // namespace

L2Normalization::L2Normalization(double eps) : BasicOperation("L2Normalization"), eps_(eps) {
  check_eps("L2Normalization", eps_);
}

LayerNorm::LayerNorm(std::vector<int64_t> normalized_shape, double eps,
                     std::optional<c10::Device> device, std::optional<at::ScalarType> dtype,
                     bool zero_centered_gamma)
    : BasicOperation("LayerNorm"),
      normalized_shape_(std::move(normalized_shape)),
      eps_(eps),
      zero_centered_gamma_(zero_centered_gamma) {
  check_normalized_shape("LayerNorm", normalized_shape_);
  check_eps("LayerNorm", eps_);
  const auto opts = param_options(device, dtype);
  // A reference into the parameter dict would dangle once "bias" grows it.
  const bool meta = register_parameter("weight", at::empty(normalized_shape_, opts)).is_meta();
  register_parameter("bias", at::empty(normalized_shape_, opts));
  if (!meta) reset_parameters();
}

void LayerNorm::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  const at::NoGradGuard no_grad;
  weight().fill_(zero_centered_gamma_ ? 0.0 : 1.0);
  bias().zero_();
}

at::Tensor LayerNorm::op_forward(OperationContext& ctx, const at::Tensor& x,
                                 const ForwardArgs& args) {
  const auto& weight = ctx.param(0, "LayerNorm");
  check_param_shape("LayerNorm", "weight", weight, normalized_shape_);
  check_param_shape("LayerNorm", "bias", ctx.param(1, "LayerNorm"), normalized_shape_);
  check_input_against_param("LayerNorm", x, weight);
  check_trailing_dims("LayerNorm", x, normalized_shape_);
  ctx.compute_dtype = compute_dtype(args, weight.scalar_type());
  const auto xc = norm_input(x, ctx.compute_dtype);
  const auto w = cast_to(weight, ctx.compute_dtype);
  const auto b = cast_to(ctx.param(1, "LayerNorm"), ctx.compute_dtype);
  at::Tensor y, mean, rstd, amax;
  if (ctx.want_output_amax) {  // the next op's FP8 cast of y takes max |y| from this pass
    std::tie(y, mean, rstd, amax) =
        kernels::layernorm_fwd_amax(xc, w, b, eps_, zero_centered_gamma_);
    ctx.output_amax = {y, amax};
  } else {
    std::tie(y, mean, rstd) = kernels::layernorm_fwd(xc, w, b, eps_, zero_centered_gamma_);
  }
  if (ctx.requires_grad) ctx.save_for_backward({xc, mean, rstd, w});
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> LayerNorm::op_backward(OperationContext& ctx,
                                                                      const at::Tensor& dy) {
  const auto& s = ctx.saved_tensors;
  auto [dx, dw, db] = kernels::layernorm_bwd(cast_to(dy, ctx.compute_dtype), s.at(0), s.at(1),
                                             s.at(2), s.at(3), zero_centered_gamma_);
  return {dx,
          {ctx.param_requires_grad.at(0) ? dw : at::Tensor(),
           ctx.param_requires_grad.at(1) ? db : at::Tensor()}};
}

RMSNorm::RMSNorm(std::vector<int64_t> normalized_shape, double eps,
                 std::optional<c10::Device> device, std::optional<at::ScalarType> dtype,
                 bool zero_centered_gamma)
    : BasicOperation("RMSNorm"),
      normalized_shape_(std::move(normalized_shape)),
      eps_(eps),
      zero_centered_gamma_(zero_centered_gamma) {
  check_normalized_shape("RMSNorm", normalized_shape_);
  check_eps("RMSNorm", eps_);
  const auto& w =
      register_parameter("weight", at::empty(normalized_shape_, param_options(device, dtype)));
  if (!w.is_meta()) reset_parameters();
}

void RMSNorm::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  const at::NoGradGuard no_grad;
  weight().fill_(zero_centered_gamma_ ? 0.0 : 1.0);
}

at::Tensor RMSNorm::op_forward(OperationContext& ctx, const at::Tensor& x,
                               const ForwardArgs& args) {
  const auto& weight = ctx.param(0, "RMSNorm");
  check_param_shape("RMSNorm", "weight", weight, normalized_shape_);
  check_input_against_param("RMSNorm", x, weight);
  check_trailing_dims("RMSNorm", x, normalized_shape_);
  ctx.compute_dtype = compute_dtype(args, weight.scalar_type());
  const auto xc = norm_input(x, ctx.compute_dtype);
  const auto w = cast_to(weight, ctx.compute_dtype);
  at::Tensor y, rstd, amax;
  if (ctx.want_output_amax) {  // the next op's FP8 cast of y takes max |y| from this pass
    std::tie(y, rstd, amax) = kernels::rmsnorm_fwd_amax(xc, w, eps_, zero_centered_gamma_);
    ctx.output_amax = {y, amax};
  } else {
    std::tie(y, rstd) = kernels::rmsnorm_fwd(xc, w, eps_, zero_centered_gamma_);
  }
  if (ctx.requires_grad) ctx.save_for_backward({xc, rstd, w});
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> RMSNorm::op_backward(OperationContext& ctx,
                                                                    const at::Tensor& dy) {
  const auto& s = ctx.saved_tensors;
  auto [dx, dw] = kernels::rmsnorm_bwd(cast_to(dy, ctx.compute_dtype), s.at(0), s.at(1), s.at(2),
                                       zero_centered_gamma_);
  return {dx, {ctx.param_requires_grad.at(0) ? dw : at::Tensor()}};
}

at::Tensor L2Normalization::op_forward(OperationContext& ctx, const at::Tensor& x,
                                       const ForwardArgs&) {
  FUSIBLE_CHECK_FLOATING("L2Normalization", "input", x);
  FUSIBLE_CHECK_MIN_DIM("L2Normalization", "input", x, 1);
  // In x's dtype under torch.autocast too, as te.ops' (and torch's norms, which autocast runs
  // in float32): a float32 QK-norm stays float32.
  ctx.compute_dtype = x.scalar_type();
  const auto xc = cast_to(x, ctx.compute_dtype);
  auto [y, rstd] = kernels::l2norm_fwd(xc, eps_);
  if (ctx.requires_grad) ctx.save_for_backward({xc, rstd});
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> L2Normalization::op_backward(OperationContext& ctx,
                                                                            const at::Tensor& dy) {
  const auto& s = ctx.saved_tensors;
  return {kernels::l2norm_bwd(cast_to(dy, ctx.compute_dtype), s.at(0), s.at(1)), {}};
}

}  // namespace fusible::ops

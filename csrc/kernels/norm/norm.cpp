// layernorm / rmsnorm / l2norm forward and backward through ATen, computed in fp32 (fp64 for fp64)
// and rounded once. Statistics (mean, rstd) are returned per row for the backward.
//
// The compute dtype of layernorm / rmsnorm is weight's: x of another floating dtype (a float32
// residual stream beside bf16 weights under autocast) is rounded to it first, as a cast would; y
// and the parameter gradients are in weight's dtype, dx (and dextra) in x's, rounded once.
#include "kernels/norm/norm.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/dispatch.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

// Statistics are computed over the trailing dims and returned over the leading dims; only sym_*
// sizes are used so the ops also trace with dynamic shapes.

// x [..., *normalized_shape] with weight [*normalized_shape]: returns the normalized dims.
std::vector<int64_t> check_norm_args(const char* op, const at::Tensor& x,
                                     const at::Tensor& weight) {
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_FLOATING(op, "weight", weight);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "weight", weight);
  const auto nd = weight.dim();
  TORCH_CHECK(x.dim() >= nd && x.sym_sizes().slice(x.dim() - nd).equals(weight.sym_sizes()), op,
              ": expected x's trailing dims to be ", weight.sym_sizes(), ", got x shape ",
              x.sym_sizes());
  std::vector<int64_t> dims;
  for (int64_t d = -nd; d < 0; ++d) dims.push_back(d);
  return dims;
}

void check_norm_bias(const char* op, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias) {
  TORCH_CHECK(bias.sym_sizes().equals(weight.sym_sizes()), op, ": expected bias of shape ",
              weight.sym_sizes(), ", got ", bias.sym_sizes());
  FUSIBLE_CHECK_SAME_DTYPE(op, "weight", weight, "bias", bias);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "bias", bias);
}

namespace {

// Sum over the leading (batch) dims: the parameter gradients.
at::Tensor sum_leading(const at::Tensor& t, int64_t nd) {
  std::vector<int64_t> lead;
  for (int64_t d = 0; d < t.dim() - nd; ++d) lead.push_back(d);
  return lead.empty() ? t : t.sum(lead);
}

// Stats over the leading dims -> broadcastable against x again.
at::Tensor expand_stat(const at::Tensor& stat, int64_t nd) {
  auto out = stat;
  for (int64_t i = 0; i < nd; ++i) out = out.unsqueeze(-1);
  return out;
}

// x as the norm computes on it: rounded to weight's dtype, then in the accumulation dtype.
at::Tensor input_acc(const at::Tensor& x, const at::Tensor& weight) {
  return upcast(x.to(weight.scalar_type()));
}

at::Tensor gamma(const at::Tensor& weight, bool zero_centered_gamma) {
  const auto w = upcast(weight);
  return zero_centered_gamma ? w + 1 : w;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(const at::Tensor& x,
                                                             const at::Tensor& weight,
                                                             const at::Tensor& bias, double eps,
                                                             bool zero_centered_gamma) {
  const auto dims = check_norm_args("layernorm_fwd", x, weight);
  check_norm_bias("layernorm_fwd", x, weight, bias);
  const auto xf = input_acc(x, weight);
  const auto mean = xf.mean(dims, /*keepdim=*/true);
  const auto var = (xf - mean).pow(2).mean(dims, /*keepdim=*/true);
  const auto rstd = at::rsqrt(var + eps);
  const auto y = (xf - mean) * rstd * gamma(weight, zero_centered_gamma) + upcast(bias);
  return {y.to(weight.scalar_type()), mean.squeeze(dims), rstd.squeeze(dims)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma) {
  const auto dims = check_norm_args("layernorm_bwd", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("layernorm_bwd", "dy", dy, x);
  const auto nd = weight.dim();
  const auto r = expand_stat(rstd, nd);
  const auto xhat = (input_acc(x, weight) - expand_stat(mean, nd)) * r;
  const auto dyf = upcast(dy);
  const auto g = dyf * gamma(weight, zero_centered_gamma);
  const auto dx = r * (g - g.mean(dims, true) - xhat * (g * xhat).mean(dims, true));
  return {dx.to(x.scalar_type()), sum_leading(dyf * xhat, nd).to(weight.scalar_type()),
          sum_leading(dyf, nd).to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_amax(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    bool zero_centered_gamma) {
  auto [y, mean, rstd] = layernorm_fwd(x, weight, bias, eps, zero_centered_gamma);
  return {y, mean, rstd, amax_of(y)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd_amax(const at::Tensor& x,
                                                                const at::Tensor& weight,
                                                                double eps,
                                                                bool zero_centered_gamma) {
  auto [y, rstd] = rmsnorm_fwd(x, weight, eps, zero_centered_gamma);
  return {y, rstd, amax_of(y)};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                               double eps, bool zero_centered_gamma) {
  const auto dims = check_norm_args("rmsnorm_fwd", x, weight);
  const auto xf = input_acc(x, weight);
  const auto rstd = at::rsqrt(xf.pow(2).mean(dims, /*keepdim=*/true) + eps);
  const auto y = xf * rstd * gamma(weight, zero_centered_gamma);
  return {y.to(weight.scalar_type()), rstd.squeeze(dims)};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma) {
  const auto dims = check_norm_args("rmsnorm_bwd", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("rmsnorm_bwd", "dy", dy, x);
  const auto nd = weight.dim();
  const auto r = expand_stat(rstd, nd);
  const auto xhat = input_acc(x, weight) * r;
  const auto dyf = upcast(dy);
  const auto g = dyf * gamma(weight, zero_centered_gamma);
  const auto dx = r * (g - xhat * (g * xhat).mean(dims, true));
  return {dx.to(x.scalar_type()), sum_leading(dyf * xhat, nd).to(weight.scalar_type())};
}

// The norm backward plus dextra: through the dispatched ops (each device's own norm backward and
// add) in the accumulation dtype, rounded once.
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra) {
  FUSIBLE_CHECK_SAME_DTYPE("rmsnorm_bwd_add", "x", x, "dextra", dextra);
  auto [dx, dw] = kernels::rmsnorm_bwd(kernels::upcast(dy), input_acc(x, weight), rstd,
                                       kernels::upcast(weight), zero_centered_gamma);
  // add_fwd checks the shape; one rounding of dx + dextra.
  return {kernels::add_fwd(dx, kernels::upcast(dextra)).to(x.scalar_type()),
          dw.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra) {
  FUSIBLE_CHECK_SAME_DTYPE("layernorm_bwd_add", "x", x, "dextra", dextra);
  auto [dx, dw, db] = kernels::layernorm_bwd(kernels::upcast(dy), input_acc(x, weight), mean, rstd,
                                             kernels::upcast(weight), zero_centered_gamma);
  return {kernels::add_fwd(dx, kernels::upcast(dextra)).to(x.scalar_type()),
          dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

namespace {

std::tuple<at::Tensor, at::Tensor> l2norm_fwd(const at::Tensor& x, double eps) {
  FUSIBLE_CHECK_FLOATING("l2norm_fwd", "x", x);
  FUSIBLE_CHECK_MIN_DIM("l2norm_fwd", "x", x, 1);
  const auto xf = upcast(x);
  const auto rstd = at::rsqrt(xf.pow(2).sum(-1, /*keepdim=*/true) + eps);
  return {(xf * rstd).to(x.scalar_type()), rstd.squeeze(-1)};
}

at::Tensor l2norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd) {
  FUSIBLE_CHECK_FLOATING("l2norm_bwd", "x", x);
  FUSIBLE_CHECK_MIN_DIM("l2norm_bwd", "x", x, 1);
  FUSIBLE_CHECK_SHAPE_LIKE("l2norm_bwd", "dy", dy, x);
  const auto r = rstd.unsqueeze(-1);
  const auto y = upcast(x) * r;
  const auto dyf = upcast(dy);
  return (r * (dyf - y * (dyf * y).sum(-1, true))).to(x.scalar_type());
}

}  // namespace

}  // namespace reference

// ---- Entry points for C++ callers (declared in norm.h).

bool norm_reads_as_is(at::ScalarType x_dtype, at::ScalarType compute_dtype) {
  const bool half = compute_dtype == at::kBFloat16 || compute_dtype == at::kHalf;
  return x_dtype == compute_dtype || (x_dtype == at::kFloat && half);
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra) {
  FUSIBLE_DISPATCH(rmsnorm_bwd_add, dy, x, rstd, weight, zero_centered_gamma, dextra);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra) {
  FUSIBLE_DISPATCH(layernorm_bwd_add, dy, x, mean, rstd, weight, zero_centered_gamma, dextra);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(const at::Tensor& x,
                                                             const at::Tensor& weight,
                                                             const at::Tensor& bias, double eps,
                                                             bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(layernorm_fwd, x, weight, bias, eps, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(layernorm_bwd, dy, x, mean, rstd, weight, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                               double eps, bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(rmsnorm_fwd, x, weight, eps, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_amax(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(layernorm_fwd_amax, x, weight, bias, eps, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd_amax(const at::Tensor& x,
                                                                const at::Tensor& weight,
                                                                double eps,
                                                                bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(rmsnorm_fwd_amax, x, weight, eps, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma) {
  FUSIBLE_DISPATCH(rmsnorm_bwd, dy, x, rstd, weight, zero_centered_gamma);
}
std::tuple<at::Tensor, at::Tensor> l2norm_fwd(const at::Tensor& x, double eps) {
  FUSIBLE_DISPATCH(l2norm_fwd, x, eps);
}
at::Tensor l2norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd) {
  FUSIBLE_DISPATCH(l2norm_bwd, dy, x, rstd);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // RMSNorm backward plus the residual's gradient: -> (rmsnorm dx + dextra, dweight).
  define(
      m,
      "rmsnorm_bwd_add(Tensor dy, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma, "
      "Tensor dextra) -> (Tensor, Tensor)");
  // LayerNorm backward plus the residual's gradient: -> (layernorm dx + dextra, dweight, dbias).
  define(m,
         "layernorm_bwd_add(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight, bool "
         "zero_centered_gamma, Tensor dextra) -> (Tensor, Tensor, Tensor)");
  // LayerNorm over the trailing weight.shape dims -> (y, mean, rstd), stats over x's leading dims,
  // stats in fp32/fp64.
  define(
      m,
      "layernorm_fwd(Tensor x, Tensor weight, Tensor bias, float eps, bool zero_centered_gamma) -> "
      "(Tensor, Tensor, Tensor)");
  // LayerNorm backward from the saved stats -> (dx, dweight, dbias).
  define(m,
         "layernorm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight, bool "
         "zero_centered_gamma) -> (Tensor, Tensor, Tensor)");
  // RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w -> (y, rstd over x's leading dims).
  define(m,
         "rmsnorm_fwd(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> (Tensor, "
         "Tensor)");
  // RMSNorm backward -> (dx, dweight).
  define(
      m,
      "rmsnorm_bwd(Tensor dy, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma) -> "
      "(Tensor, Tensor)");
  // The forwards plus max |y| ([1] fp32) from the same pass: what an FP8 cast of y needs
  // (fp8_cast_with_amax), without reading y again.
  define(m,
         "layernorm_fwd_amax(Tensor x, Tensor weight, Tensor bias, float eps, bool "
         "zero_centered_gamma) -> (Tensor, Tensor, Tensor, Tensor)");
  define(m,
         "rmsnorm_fwd_amax(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> "
         "(Tensor, Tensor, Tensor)");
  // L2 normalization over the last dim: y = x * rsqrt(sum(x^2) + eps) -> (y, rstd [...]).
  define(m, "l2norm_fwd(Tensor x, float eps) -> (Tensor, Tensor)");
  // L2 normalization backward -> dx.
  define(m, "l2norm_bwd(Tensor dy, Tensor x, Tensor rstd) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("layernorm_fwd", &reference::layernorm_fwd);
  m.impl("layernorm_bwd", &reference::layernorm_bwd);
  m.impl("rmsnorm_fwd", &reference::rmsnorm_fwd);
  m.impl("rmsnorm_bwd", &reference::rmsnorm_bwd);
  m.impl("layernorm_fwd_amax", &reference::layernorm_fwd_amax);
  m.impl("rmsnorm_fwd_amax", &reference::rmsnorm_fwd_amax);
  m.impl("l2norm_fwd", &reference::l2norm_fwd);
  m.impl("l2norm_bwd", &reference::l2norm_bwd);
  m.impl("rmsnorm_bwd_add", &reference::rmsnorm_bwd_add);
  m.impl("layernorm_bwd_add", &reference::layernorm_bwd_add);
}

}  // namespace fusible::kernels

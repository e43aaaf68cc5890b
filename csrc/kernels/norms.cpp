// layernorm / rmsnorm / l2norm forward and backward through ATen, computed in fp32 (fp64 for fp64)
// and rounded once. Statistics (mean, rstd) are returned per row for the backward.
#include <ATen/ops/rsqrt.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/compute_dtype.h"

namespace fusible::kernels {
namespace {

// x [..., *normalized_shape] with weight [*normalized_shape]: returns the row count.
int64_t check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "weight", weight);
  FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "weight", weight);
  const auto nd = weight.dim();
  TORCH_CHECK(x.dim() >= nd && x.sizes().slice(x.dim() - nd).equals(weight.sizes()), op,
              ": expected x's trailing dims to be ", weight.sizes(), ", got x shape ", shape_str(x));
  const int64_t d = weight.numel();
  return d == 0 ? 0 : x.numel() / d;
}

at::Tensor gamma(const at::Tensor& weight, bool zero_centered_gamma) {
  const auto w = upcast(weight).reshape({-1});
  return zero_centered_gamma ? w + 1 : w;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(const at::Tensor& x,
                                                             const at::Tensor& weight,
                                                             const at::Tensor& bias, double eps,
                                                             bool zero_centered_gamma) {
  const auto rows = check_norm_args("layernorm_fwd", x, weight);
  TORCH_CHECK(bias.sizes().equals(weight.sizes()), "layernorm_fwd: expected bias of shape ",
              weight.sizes(), ", got ", bias.sizes());
  FUSIBLE_CHECK_SAME_DTYPE("layernorm_fwd", "x", x, "bias", bias);
  const auto xf = upcast(x).reshape({rows, weight.numel()});
  const auto mean = xf.mean(-1, /*keepdim=*/true);
  const auto var = (xf - mean).pow(2).mean(-1, /*keepdim=*/true);
  const auto rstd = at::rsqrt(var + eps);
  const auto y = (xf - mean) * rstd * gamma(weight, zero_centered_gamma) + upcast(bias).reshape({-1});
  return {y.to(x.scalar_type()).reshape(x.sizes()), mean.reshape({rows}), rstd.reshape({rows})};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma) {
  const auto rows = check_norm_args("layernorm_bwd", x, weight);
  FUSIBLE_CHECK_SIZE("layernorm_bwd", "dy.numel()", dy.numel(), x.numel());
  const auto d = weight.numel();
  const auto xhat = (upcast(x).reshape({rows, d}) - mean.reshape({rows, 1})) * rstd.reshape({rows, 1});
  const auto dyf = upcast(dy).reshape({rows, d});
  const auto g = dyf * gamma(weight, zero_centered_gamma);
  const auto dx = rstd.reshape({rows, 1}) *
                  (g - g.mean(-1, true) - xhat * (g * xhat).mean(-1, true));
  const auto dw = (dyf * xhat).sum(0).reshape(weight.sizes());
  const auto db = dyf.sum(0).reshape(weight.sizes());
  return {dx.to(x.scalar_type()).reshape(x.sizes()), dw.to(weight.scalar_type()),
          db.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                               double eps, bool zero_centered_gamma) {
  const auto rows = check_norm_args("rmsnorm_fwd", x, weight);
  const auto xf = upcast(x).reshape({rows, weight.numel()});
  const auto rstd = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const auto y = xf * rstd * gamma(weight, zero_centered_gamma);
  return {y.to(x.scalar_type()).reshape(x.sizes()), rstd.reshape({rows})};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma) {
  const auto rows = check_norm_args("rmsnorm_bwd", x, weight);
  FUSIBLE_CHECK_SIZE("rmsnorm_bwd", "dy.numel()", dy.numel(), x.numel());
  const auto d = weight.numel();
  const auto r = rstd.reshape({rows, 1});
  const auto xhat = upcast(x).reshape({rows, d}) * r;
  const auto dyf = upcast(dy).reshape({rows, d});
  const auto g = dyf * gamma(weight, zero_centered_gamma);
  const auto dx = r * (g - xhat * (g * xhat).mean(-1, true));
  const auto dw = (dyf * xhat).sum(0).reshape(weight.sizes());
  return {dx.to(x.scalar_type()).reshape(x.sizes()), dw.to(weight.scalar_type())};
}

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
  FUSIBLE_CHECK_SIZE("l2norm_bwd", "dy.numel()", dy.numel(), x.numel());
  const auto r = rstd.unsqueeze(-1);
  const auto y = upcast(x) * r;
  const auto dyf = upcast(dy).reshape(x.sizes());
  return (r * (dyf - y * (dyf * y).sum(-1, true))).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("layernorm_fwd", &layernorm_fwd);
  m.impl("layernorm_bwd", &layernorm_bwd);
  m.impl("rmsnorm_fwd", &rmsnorm_fwd);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd);
  m.impl("l2norm_fwd", &l2norm_fwd);
  m.impl("l2norm_bwd", &l2norm_bwd);
}

}  // namespace fusible::kernels

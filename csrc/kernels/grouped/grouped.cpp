// grouped_linear_fwd / _dgrad / _wgrad and grouped_bias_bwd: argument checks, the CPU reference
// (one ATen GEMM per group, the split read on the host) and the Meta (shape-only) versions.
#include "kernels/grouped/grouped.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/sum.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {

void check_grouped_rows(const char* op, const char* x_name, const at::Tensor& x,
                        const at::Tensor& split_sizes) {
  FUSIBLE_CHECK_FLOATING(op, x_name, x);
  FUSIBLE_CHECK_DIM(op, x_name, x, 2);
  TORCH_CHECK_VALUE(split_sizes.scalar_type() == at::kInt || split_sizes.scalar_type() == at::kLong,
                    op, ": expected split sizes of dtype int32 or int64, got ",
                    split_sizes.scalar_type());
  TORCH_CHECK_VALUE(split_sizes.dim() == 1 && split_sizes.sym_numel() > 0, op,
                    ": expected 1-D split sizes with one entry per group, got shape ",
                    split_sizes.sym_sizes());
  FUSIBLE_CHECK_SAME_DEVICE(op, x_name, x, "split_sizes", split_sizes);
}

void check_grouped_weight(const char* op, const char* x_name, const at::Tensor& x,
                          const at::Tensor& weight, const at::Tensor& split_sizes, int64_t in_dim) {
  FUSIBLE_CHECK_DIM(op, "weight", weight, 3);
  FUSIBLE_CHECK_SAME_DEVICE(op, x_name, x, "weight", weight);
  FUSIBLE_CHECK_SAME_DTYPE(op, x_name, x, "weight", weight);
  TORCH_CHECK_VALUE(weight.sym_size(0) == split_sizes.sym_size(0), op,
                    ": expected split sizes of shape [", weight.sym_size(0),
                    "] (one per group), got ", split_sizes.sym_sizes());
  TORCH_CHECK(x.sym_size(1) == weight.sym_size(in_dim), op, ": expected ", x_name,
              ".size(1) == ", weight.sym_size(in_dim), ", got ", x.sym_size(1), " (", x_name,
              " shape ", x.sym_sizes(), ", weight shape ", weight.sym_sizes(), ")");
}

void check_grouped_scales(const char* op, const at::Tensor& x, const at::Tensor& scales) {
  FUSIBLE_CHECK_FLOATING(op, "scales", scales);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "scales", scales);
  TORCH_CHECK(scales.dim() == 1 && scales.sym_size(0) == x.sym_size(0), op,
              ": expected scales of shape [", x.sym_size(0), "] (one per row), got ",
              scales.sym_sizes());
}

void check_grouped_bias(const char* op, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& scales) {
  if (bias.has_value()) {
    FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "bias", *bias);
    FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "bias", *bias);
    TORCH_CHECK(bias->dim() == 2 && bias->sym_size(0) == weight.sym_size(0) &&
                    bias->sym_size(1) == weight.sym_size(1),
                op, ": expected bias of shape [", weight.sym_size(0), ", ", weight.sym_size(1),
                "], got ", bias->sym_sizes());
  }
  if (scales.has_value()) {
    TORCH_CHECK(bias.has_value(), op, ": scales scale the bias, but no bias was given");
    check_grouped_scales(op, x, *scales);
  }
}

void check_grouped_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                         const at::Tensor& split_sizes) {
  check_grouped_rows(op, "dy", dy, split_sizes);
  check_grouped_rows(op, "x", x, split_sizes);
  FUSIBLE_CHECK_SAME_DTYPE(op, "dy", dy, "x", x);
  TORCH_CHECK(dy.sym_size(0) == x.sym_size(0), op,
              ": expected dy and x with the same number of rows, got shapes ", dy.sym_sizes(),
              " and ", x.sym_sizes());
}

void check_grouped_bias_bwd(const char* op, const at::Tensor& dy, const at::Tensor& split_sizes,
                            const std::optional<at::Tensor>& scales,
                            const std::optional<at::Tensor>& bias) {
  check_grouped_rows(op, "dy", dy, split_sizes);
  if (scales.has_value()) check_grouped_scales(op, dy, *scales);
  if (bias.has_value()) {
    TORCH_CHECK(scales.has_value(), op, ": the bias is only needed for the scales' gradient");
    FUSIBLE_CHECK_SAME_DTYPE(op, "dy", dy, "bias", *bias);
    FUSIBLE_CHECK_SAME_DEVICE(op, "dy", dy, "bias", *bias);
    TORCH_CHECK(bias->dim() == 2 && bias->sym_size(0) == split_sizes.sym_size(0) &&
                    bias->sym_size(1) == dy.sym_size(1),
                op, ": expected bias of shape [", split_sizes.sym_size(0), ", ", dy.sym_size(1),
                "], got ", bias->sym_sizes());
  }
}

namespace {

// The split on the host, checked against the rows it splits.
std::vector<int64_t> host_split(const char* op, const at::Tensor& split_sizes, int64_t rows) {
  const auto sizes = split_sizes.to(at::kLong).contiguous();
  const auto* p = sizes.const_data_ptr<int64_t>();
  std::vector<int64_t> out(p, p + sizes.numel());
  int64_t total = 0;
  for (size_t g = 0; g < out.size(); ++g) {
    TORCH_CHECK_VALUE(out[g] >= 0, op, ": expected non-negative split sizes, got ", out[g],
                      " for group ", g);
    total += out[g];
  }
  TORCH_CHECK_VALUE(total == rows, op, ": expected split sizes summing to the input's ", rows,
                    " rows, got ", total);
  return out;
}

at::Tensor grouped_linear_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& split_sizes,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& scales) {
  constexpr const char* op = "grouped_linear_fwd";
  check_grouped_rows(op, "x", x, split_sizes);
  check_grouped_weight(op, "x", x, weight, split_sizes, 2);
  check_grouped_bias(op, x, weight, bias, scales);
  const auto sizes = host_split(op, split_sizes, x.size(0));
  auto y = at::empty({x.size(0), weight.size(1)}, x.options());
  const auto acc = acc_dtype(x.scalar_type());
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); start += sizes[g], ++g) {
    if (sizes[g] == 0) continue;
    auto y_g = y.narrow(0, start, sizes[g]);
    const auto x_g = x.narrow(0, start, sizes[g]);
    if (!bias.has_value()) {
      at::mm_out(y_g, x_g, weight[g].t());
      continue;
    }
    // The bias joins the product in the accumulation dtype: one rounding, as on CUDA.
    auto b = (*bias)[g].to(acc);
    if (scales.has_value()) b = scales->narrow(0, start, sizes[g]).to(acc).unsqueeze(-1) * b;
    y_g.copy_(at::mm(x_g.to(acc), weight[g].t().to(acc)) + b);
  }
  return y;
}

at::Tensor grouped_linear_dgrad_cpu(const at::Tensor& dy, const at::Tensor& weight,
                                    const at::Tensor& split_sizes) {
  constexpr const char* op = "grouped_linear_dgrad";
  check_grouped_rows(op, "dy", dy, split_sizes);
  check_grouped_weight(op, "dy", dy, weight, split_sizes, 1);
  const auto sizes = host_split(op, split_sizes, dy.size(0));
  auto dx = at::empty({dy.size(0), weight.size(2)}, dy.options());
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); start += sizes[g], ++g) {
    if (sizes[g] == 0) continue;
    auto dx_g = dx.narrow(0, start, sizes[g]);
    at::mm_out(dx_g, dy.narrow(0, start, sizes[g]), weight[g]);
  }
  return dx;
}

at::Tensor grouped_linear_wgrad_cpu(const at::Tensor& dy, const at::Tensor& x,
                                    const at::Tensor& split_sizes) {
  constexpr const char* op = "grouped_linear_wgrad";
  check_grouped_wgrad(op, dy, x, split_sizes);
  const auto sizes = host_split(op, split_sizes, dy.size(0));
  auto dw = at::empty({split_sizes.size(0), dy.size(1), x.size(1)}, dy.options());
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); start += sizes[g], ++g) {
    auto dw_g = dw[g];  // an empty group: a product over no rows, zeros
    at::mm_out(dw_g, dy.narrow(0, start, sizes[g]).t(), x.narrow(0, start, sizes[g]));
  }
  return dw;
}

std::tuple<at::Tensor, at::Tensor> grouped_bias_bwd_cpu(const at::Tensor& dy,
                                                        const at::Tensor& split_sizes,
                                                        const std::optional<at::Tensor>& scales,
                                                        const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "grouped_bias_bwd";
  check_grouped_bias_bwd(op, dy, split_sizes, scales, bias);
  const auto sizes = host_split(op, split_sizes, dy.size(0));
  const auto acc = acc_dtype(dy.scalar_type());
  auto dbias = at::empty({split_sizes.size(0), dy.size(1)}, dy.options());
  auto dscales = at::empty({bias.has_value() ? dy.size(0) : 0}, dy.options().dtype(acc));
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); start += sizes[g], ++g) {
    auto dy_g = dy.narrow(0, start, sizes[g]).to(acc);
    if (scales.has_value()) {
      dbias[g].copy_((dy_g * scales->narrow(0, start, sizes[g]).to(acc).unsqueeze(-1)).sum(0));
    } else {
      dbias[g].copy_(dy_g.sum(0));
    }
    if (bias.has_value() && sizes[g] > 0) {
      dscales.narrow(0, start, sizes[g]).copy_(at::mv(dy_g, (*bias)[g].to(acc)));
    }
  }
  return {dbias, bias.has_value() ? dscales.to(scales->scalar_type()) : dscales};
}

// ---- Meta: shapes only (symbolic row counts stay symbolic).

at::Tensor grouped_linear_fwd_meta(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& split_sizes,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& scales) {
  constexpr const char* op = "grouped_linear_fwd";
  check_grouped_rows(op, "x", x, split_sizes);
  check_grouped_weight(op, "x", x, weight, split_sizes, 2);
  check_grouped_bias(op, x, weight, bias, scales);
  return at::empty_symint({x.sym_size(0), weight.sym_size(1)}, x.options());
}

at::Tensor grouped_linear_dgrad_meta(const at::Tensor& dy, const at::Tensor& weight,
                                     const at::Tensor& split_sizes) {
  constexpr const char* op = "grouped_linear_dgrad";
  check_grouped_rows(op, "dy", dy, split_sizes);
  check_grouped_weight(op, "dy", dy, weight, split_sizes, 1);
  return at::empty_symint({dy.sym_size(0), weight.sym_size(2)}, dy.options());
}

at::Tensor grouped_linear_wgrad_meta(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& split_sizes) {
  check_grouped_wgrad("grouped_linear_wgrad", dy, x, split_sizes);
  return at::empty_symint({split_sizes.sym_size(0), dy.sym_size(1), x.sym_size(1)}, dy.options());
}

std::tuple<at::Tensor, at::Tensor> grouped_bias_bwd_meta(const at::Tensor& dy,
                                                         const at::Tensor& split_sizes,
                                                         const std::optional<at::Tensor>& scales,
                                                         const std::optional<at::Tensor>& bias) {
  check_grouped_bias_bwd("grouped_bias_bwd", dy, split_sizes, scales, bias);
  auto dbias = at::empty_symint({split_sizes.sym_size(0), dy.sym_size(1)}, dy.options());
  if (!bias.has_value()) {
    return {dbias, at::empty({0}, dy.options().dtype(acc_dtype(dy.scalar_type())))};
  }
  return {dbias, at::empty_symint({dy.sym_size(0)}, scales->options())};
}

}  // namespace

// ---- Entry points for C++ callers (declared in grouped.h).

at::Tensor grouped_linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& split_sizes, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& scales) {
  FUSIBLE_DISPATCH(grouped_linear_fwd, x, weight, split_sizes, bias, scales);
}
at::Tensor grouped_linear_dgrad(const at::Tensor& dy, const at::Tensor& weight,
                                const at::Tensor& split_sizes) {
  FUSIBLE_DISPATCH(grouped_linear_dgrad, dy, weight, split_sizes);
}
at::Tensor grouped_linear_wgrad(const at::Tensor& dy, const at::Tensor& x,
                                const at::Tensor& split_sizes) {
  FUSIBLE_DISPATCH(grouped_linear_wgrad, dy, x, split_sizes);
}
std::tuple<at::Tensor, at::Tensor> grouped_bias_bwd(const at::Tensor& dy,
                                                    const at::Tensor& split_sizes,
                                                    const std::optional<at::Tensor>& scales,
                                                    const std::optional<at::Tensor>& bias) {
  FUSIBLE_DISPATCH(grouped_bias_bwd, dy, split_sizes, scales, bias);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // GroupedLinear's grouped GEMMs: the rows of x [T, K] split into G consecutive groups by
  // split_sizes (int32 / int64 [G] on x's device; non-negative, summing to T: checked on the host
  // on CPU, by a device-side assert on CUDA, where the split never reaches the host).
  // y_g = x_g W_g^T + b_g (times the row's scale when scales [T] is given). weight: [G, N, K],
  // bias: [G, N] -> [T, N].
  define(
      m,
      "grouped_linear_fwd(Tensor x, Tensor weight, Tensor split_sizes, Tensor? bias=None, Tensor? "
      "scales=None) -> Tensor");
  // dx_g = dy_g W_g. dy: [T, N], weight: [G, N, K] -> [T, K].
  define(m, "grouped_linear_dgrad(Tensor dy, Tensor weight, Tensor split_sizes) -> Tensor");
  // dW_g = dy_g^T x_g (zeros for an empty group). dy: [T, N], x: [T, K] -> [G, N, K].
  define(m, "grouped_linear_wgrad(Tensor dy, Tensor x, Tensor split_sizes) -> Tensor");
  // -> (dbias [G, N]: dy summed over each group's rows, times the scales when given; dscales [T]:
  // dy_r . b_g in the scales' dtype when bias is given, else [0]).
  define(
      m,
      "grouped_bias_bwd(Tensor dy, Tensor split_sizes, Tensor? scales=None, Tensor? bias=None) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("grouped_linear_fwd", &grouped_linear_fwd_cpu);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad_cpu);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad_cpu);
  m.impl("grouped_bias_bwd", &grouped_bias_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) {
  m.impl("grouped_linear_fwd", &grouped_linear_fwd_meta);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad_meta);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad_meta);
  m.impl("grouped_bias_bwd", &grouped_bias_bwd_meta);
}

}  // namespace fusible::kernels

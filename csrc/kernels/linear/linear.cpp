// linear_fwd / linear_dgrad / linear_wgrad: the GEMMs of BasicLinear through ATen (CPU reference,
// CUDA via cuBLAS, Meta via ATen's meta kernels). Own cuBLASLt epilogues come later.
#include "kernels/linear/linear.h"

#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"

namespace fusible::kernels {
namespace reference {

void check_linear_args(const char* op, const char* x_name, const at::Tensor& x,
                       const at::Tensor& weight, int64_t x_dim_size, const char* expect) {
  FUSIBLE_CHECK_FLOATING(op, x_name, x);
  FUSIBLE_CHECK_MIN_DIM(op, x_name, x, 1);
  FUSIBLE_CHECK_DIM(op, "weight", weight, 2);
  FUSIBLE_CHECK_SAME_DEVICE(op, x_name, x, "weight", weight);
  FUSIBLE_CHECK_SAME_DTYPE(op, x_name, x, "weight", weight);
  TORCH_CHECK(x.size(-1) == x_dim_size, op, ": expected ", x_name, ".size(-1) == ", x_dim_size,
              " (", expect, "), got ", x.size(-1), " (", x_name, " shape ", shape_str(x),
              ", weight shape ", shape_str(weight), ")");
}

void check_wgrad_args(const at::Tensor& dy, const at::Tensor& x) {
  FUSIBLE_CHECK_FLOATING("linear_wgrad", "dy", dy);
  FUSIBLE_CHECK_FLOATING("linear_wgrad", "x", x);
  FUSIBLE_CHECK_MIN_DIM("linear_wgrad", "dy", dy, 1);
  FUSIBLE_CHECK_MIN_DIM("linear_wgrad", "x", x, 1);
  FUSIBLE_CHECK_SAME_DTYPE("linear_wgrad", "dy", dy, "x", x);
  FUSIBLE_CHECK_SAME_DEVICE("linear_wgrad", "dy", dy, "x", x);
  const auto rows = [](const at::Tensor& t) { return t.reshape({-1, t.size(-1)}).sym_size(0); };
  TORCH_CHECK(rows(dy) == rows(x), "linear_wgrad: expected dy and x with the same number of rows, ",
              "got shapes ", dy.sym_sizes(), " and ", x.sym_sizes());
}

void check_fwd_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  check_linear_args(op, "x", x, weight, weight.size(1), "weight.size(1), in_features");
  if (bias.has_value()) {
    FUSIBLE_CHECK_DIM(op, "bias", *bias, 1);
    FUSIBLE_CHECK_SIZE(op, "bias.size(0)", bias->size(0), weight.size(0));
    FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "bias", *bias);
    FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "bias", *bias);
  }
}

at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  check_fwd_args("linear_fwd", x, weight, bias);
  return at::linear(x, weight, bias).contiguous();
}

at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha) {
  check_linear_args("linear_dgrad", "dy", dy, weight, weight.size(0),
                    "weight.size(0), out_features");
  if (alpha == 1.0) return at::matmul(dy, weight).contiguous();
  // Scaled in the accumulation dtype: one rounding, as the CUDA epilogue's.
  return at::matmul(upcast(dy), upcast(weight)).mul_(alpha).to(dy.scalar_type()).contiguous();
}

at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha) {
  check_wgrad_args(dy, x);
  const auto dy2 = dy.reshape({-1, dy.size(-1)});
  const auto x2 = x.reshape({-1, x.size(-1)});
  if (alpha == 1.0) return at::mm(dy2.t(), x2);
  return at::mm(upcast(dy2).t(), upcast(x2)).mul_(alpha).to(dy.scalar_type());
}

}  // namespace reference

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("linear_fwd", &reference::linear_fwd);
  m.impl("linear_dgrad", &reference::linear_dgrad);
  m.impl("linear_wgrad", &reference::linear_wgrad);
}

}  // namespace fusible::kernels

// fp8_cast_grouped: per-tensor current-scaling casts of groups of consecutive rows (an MoE
// layer's experts), each group with the scale of its own amax: checks, the ATen version (CPU, one
// fp8_cast per group), Meta. CUDA: fp8_cuda.cpp (two kernels for all groups).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "common/checks.h"
#include "kernels/fp8/fp8.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {

void check_fp8_cast_grouped_args(const at::Tensor& x, at::IntArrayRef sizes,
                                 c10::string_view format, double margin) {
  constexpr const char* op = "fp8_cast_grouped";
  check_fp8_cast_args(op, x, format, margin);
  FUSIBLE_CHECK_DIM(op, "x", x, 2);
  int64_t total = 0;
  for (const auto m : sizes) {
    TORCH_CHECK_VALUE(m >= 0, op, ": expected non-negative group sizes, got ", sizes);
    total += m;
  }
  TORCH_CHECK_VALUE(x.sym_size(0) == total, op, ": expected the group sizes to add up to x's ",
                    x.sym_size(0), " rows, got ", sizes, " (", total, ")");
}

namespace {

Fp8Cast grouped_outputs(const at::Tensor& x, at::IntArrayRef sizes, c10::string_view format,
                        bool transpose) {
  const auto fp8 = fp8_dtype("fp8_cast_grouped", format);
  auto data = at::empty_symint(x.sym_sizes(), x.options().dtype(fp8));
  auto data_t = transpose ? at::empty_symint({x.sym_numel()}, data.options())
                          : at::empty({0}, data.options());
  auto scale_inv = at::empty({static_cast<int64_t>(sizes.size())}, x.options().dtype(at::kFloat));
  return {data, data_t, scale_inv};
}

Fp8Cast fp8_cast_grouped_meta(const at::Tensor& x, at::IntArrayRef sizes, c10::string_view format,
                              double margin, bool transpose) {
  check_fp8_cast_grouped_args(x, sizes, format, margin);
  return grouped_outputs(x, sizes, format, transpose);
}

}  // namespace

namespace reference {

Fp8Cast fp8_cast_grouped(const at::Tensor& x, at::IntArrayRef sizes, c10::string_view format,
                         double margin, bool transpose) {
  check_fp8_cast_grouped_args(x, sizes, format, margin);
  auto out = grouped_outputs(x, sizes, format, transpose);
  auto& [data, data_t, scale_inv] = out;
  const int64_t cols = x.size(1);
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t m = sizes[g];
    const auto [d, dt, si] = fp8_cast(x.narrow(0, start, m), format, margin, transpose, "none");
    data.narrow(0, start, m).copy_(d);
    if (transpose) data_t.narrow(0, start * cols, m * cols).copy_(dt.reshape({-1}));
    scale_inv.narrow(0, g, 1).copy_(si);
    start += m;
  }
  return out;
}

}  // namespace reference

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_grouped(const at::Tensor& x,
                                                                at::IntArrayRef sizes,
                                                                const std::string& format,
                                                                double margin, bool transpose) {
  FUSIBLE_DISPATCH(fp8_cast_grouped, x, sizes, format, margin, transpose);
}

TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // Current-scaling FP8 data of groups of consecutive rows of x [T, K] (sizes: each group's rows,
  // adding up to T), each group cast as fp8_cast casts a tensor (its own amax and scale) ->
  // (data [T, K]; data_t [T * K] holding each group's [K, rows_g] transpose at K * its first row
  // (empty unless transpose); scale_inv [groups] fp32).
  define(m,
         "fp8_cast_grouped(Tensor x, int[] sizes, str format, float margin=0.0, bool "
         "transpose=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) { m.impl("fp8_cast_grouped", &reference::fp8_cast_grouped); }

TORCH_LIBRARY_IMPL(fusible, Meta, m) { m.impl("fp8_cast_grouped", &fp8_cast_grouped_meta); }

}  // namespace fusible::kernels

// fp8_cast_block: checks, the ATen version (CPU, and CUDA where the kernel does not apply), Meta.
// CUDA: fp8_block_cuda.cpp.
#include "kernels/fp8/fp8_block.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/fp8/fp8.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace {

constexpr int64_t kBlock = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// The [RB, KB] matrix of block values placed into block_scale_shape(rows, cols, block_dim).
at::Tensor to_layout(const at::Tensor& per_block, int64_t rows, int64_t cols, int64_t block_dim) {
  auto out = at::zeros(block_scale_shape(rows, cols, block_dim), per_block.options());
  if (block_dim == 1) {
    out.narrow(1, 0, rows).copy_(per_block.t());  // [KB, rows]
  } else {
    out.narrow(1, 0, per_block.size(1)).copy_(per_block);  // [RB, KB]
  }
  return out;
}

// The inverse of to_layout: [RB, KB].
at::Tensor from_layout(const at::Tensor& layout, int64_t rows, int64_t cols, int64_t block_dim) {
  if (block_dim == 1) return layout.narrow(1, 0, rows).t();
  return layout.narrow(1, 0, ceil_div(cols, kBlock));
}

}  // namespace

std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols, int64_t block_dim) {
  if (block_dim == 1) return {ceil_div(cols, kBlock), round_up(rows, 4)};
  return {ceil_div(rows, kBlock), round_up(ceil_div(cols, kBlock), 4)};
}

void check_fp8_cast_block_args(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                               bool rowwise, bool columnwise) {
  constexpr const char* op = "fp8_cast_block";
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_MIN_DIM(op, "x", x, 1);
  fp8_max(op, format);
  TORCH_CHECK_VALUE(block_dim == 1 || block_dim == 2, op,
                    ": expected block_dim 1 (1x128 blocks) or 2 (128x128), got ", block_dim);
  TORCH_CHECK_VALUE(rowwise || columnwise, op,
                    ": expected rowwise or columnwise (or both) to be asked for");
}

namespace reference {

Fp8BlockCast fp8_cast_block(const at::Tensor& x_in, c10::string_view format, int64_t block_dim,
                            bool rowwise, bool columnwise, c10::string_view act) {
  constexpr const char* op = "fp8_cast_block";
  check_fp8_cast_block_args(x_in, format, block_dim, rowwise, columnwise);
  const auto x = cast_source(op, x_in, act);
  const double max = fp8_max(op, format);
  const auto fp8 = fp8_dtype(op, format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const int64_t cols = x.size(-1), rows = cols > 0 ? x.numel() / cols : 0;
  const auto x2d = xf.reshape({rows, cols});
  const auto none = at::empty({0}, x.options().dtype(fp8));
  const auto no_scale = at::empty({0}, x.options().dtype(at::kFloat));
  const auto cast = [&](const at::Tensor& m, int64_t r,
                        int64_t c) -> std::pair<at::Tensor, at::Tensor> {
    if (m.numel() == 0) {
      return {at::empty({r, c}, none.options()),
              at::zeros(block_scale_shape(r, c, block_dim), no_scale.options())};
    }
    const auto scale = block_scales(m, max, block_dim, /*power_2_scale=*/true);
    const auto data = (m * expand_block_scales(scale, r, c, block_dim)).clamp(-max, max).to(fp8);
    return {data, to_layout(scale.reciprocal().to(at::kFloat), r, c, block_dim)};
  };
  at::Tensor data = none, scale_inv = no_scale, data_t = none, scale_inv_t = no_scale;
  if (rowwise) {
    std::tie(data, scale_inv) = cast(x2d, rows, cols);
    data = data.reshape(x.sizes());
  }
  if (columnwise) std::tie(data_t, scale_inv_t) = cast(x2d.t().contiguous(), cols, rows);
  return {data, scale_inv, data_t, scale_inv_t};
}

at::Tensor dequantize_block(const at::Tensor& data, const at::Tensor& scale_inv,
                            int64_t block_dim) {
  const int64_t cols = data.size(-1), rows = cols > 0 ? data.numel() / cols : 0;
  const auto per_block = from_layout(scale_inv, rows, cols, block_dim);
  return data.reshape({rows, cols}).to(at::kFloat) *
         expand_block_scales(per_block, rows, cols, block_dim);
}

}  // namespace reference

namespace {

// block_scale_shape on symbolic sizes (torch.compile's dynamic shapes).
std::vector<c10::SymInt> block_scale_sym_shape(const c10::SymInt& rows, const c10::SymInt& cols,
                                               int64_t block_dim) {
  const auto blocks = [](const c10::SymInt& n) { return (n + (kBlock - 1)) / kBlock; };
  const auto up4 = [](const c10::SymInt& n) { return (n + 3) / 4 * 4; };
  if (block_dim == 1) return {blocks(cols), up4(rows)};
  return {blocks(rows), up4(blocks(cols))};
}

Fp8BlockCast fp8_cast_block_meta(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                                 bool rowwise, bool columnwise, c10::string_view act) {
  check_fp8_cast_block_args(x, format, block_dim, rowwise, columnwise);
  cast_activation("fp8_cast_block", act);
  const auto fp8 = x.options().dtype(fp8_dtype("fp8_cast_block", format));
  const auto f32 = x.options().dtype(at::kFloat);
  const auto cols = x.sym_size(-1), rows = x.sym_numel() / cols;
  const auto none = [&](const at::TensorOptions& o) { return at::empty({0}, o); };
  return {
      rowwise ? at::empty_symint(x.sym_sizes(), fp8) : none(fp8),
      rowwise ? at::empty_symint(block_scale_sym_shape(rows, cols, block_dim), f32) : none(f32),
      columnwise ? at::empty_symint({cols, rows}, fp8) : none(fp8),
      columnwise ? at::empty_symint(block_scale_sym_shape(cols, rows, block_dim), f32) : none(f32)};
}

}  // namespace

// ---- Entry points for C++ callers (declared in fp8_block.h).

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_cast_block(
    const at::Tensor& x, const std::string& format, int64_t block_dim, bool rowwise,
    bool columnwise, const std::string& act) {
  FUSIBLE_DISPATCH(fp8_cast_block, x, format, block_dim, rowwise, columnwise, act);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // Block-scaled FP8 cast (Float8BlockScaling) as cuBLASLt's block-scaled GEMMs read it: x as
  // [M, K] in 1x128 (block_dim 1) or 128x128 (2) blocks with power-of-two scales -> (data,
  // scale_inv [ceil(K/128), M rounded up to 4] or [ceil(M/128), ceil(K/128) rounded up to 4],
  // data_t [K, M] (columnwise: x^T cast the same way), its scale_inv); parts not asked for [0].
  // act: as fp8_cast's.
  define(m,
         "fp8_cast_block(Tensor x, str format, int block_dim, bool rowwise=True, bool "
         "columnwise=False, str act=\"none\") -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) { m.impl("fp8_cast_block", &reference::fp8_cast_block); }

TORCH_LIBRARY_IMPL(fusible, Meta, m) { m.impl("fp8_cast_block", &fp8_cast_block_meta); }

}  // namespace fusible::kernels

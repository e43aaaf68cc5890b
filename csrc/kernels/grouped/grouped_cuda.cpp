// The grouped GEMMs on CUDA with the split sizes left on the device: one kernel checks them and
// writes the group table, then torch._grouped_mm's CUTLASS kernels (bf16 on Hopper / Blackwell) or
// our SIMT grouped GEMM, and the grouped bias-gradient kernels. No host synchronization:
// CUDA-graph safe.
#include <ATen/ops/_grouped_mm.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/grouped/grouped.h"
#include "kernels/grouped/grouped_launchers.h"

namespace fusible::kernels {
namespace {

// The split checked on the device (an asynchronous device-side assert when bad) as the int32
// group table of grouped_launchers.h.
at::Tensor group_table(const char* op, const at::Tensor& split_sizes, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op,
              ": expected fewer than 2^31 rows, got ", rows);
  const int64_t groups = split_sizes.numel();
  TORCH_CHECK_VALUE(groups <= kMaxGroups, op, ": expected at most ", kMaxGroups,
                    " groups on CUDA, got ", groups);
  auto table = at::empty({group_table_size(groups)}, split_sizes.options().dtype(at::kInt));
  const auto sizes = split_sizes.contiguous();
  launch_group_table(sizes.const_data_ptr(), sizes.scalar_type() == at::kLong, groups, rows,
                     table.mutable_data_ptr<int32_t>(), c10::cuda::getCurrentCUDAStream());
  return table;
}

// torch._grouped_mm's CUTLASS path: bf16, Hopper or Blackwell, every matrix 16-byte aligned with
// one unit stride among its last two dims, at most 1024 groups (one thread each in its setup).
bool cutlass_layout(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  const int64_t d = t.dim();
  const auto s = t.strides();
  const bool row = s[d - 1] == 1 && s[d - 2] % 8 == 0;
  const bool col = s[d - 2] == 1 && s[d - 1] % 8 == 0;
  return (row || col) && (d == 2 || s[0] % 8 == 0);
}

bool use_grouped_mm(const at::Tensor& a, const at::Tensor& b, int64_t groups) {
  const int major = current_sm_major();
  return a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 &&
         (major == 9 || major == 10) && groups <= 1024 && a.numel() > 0 && b.numel() > 0 &&
         cutlass_layout(a) && cutlass_layout(b);
}

// torch._grouped_mm has no bias epilogue, and adding the bias to its rounded output would round
// twice (far off where x W and b cancel): the bias joins the GEMM as one more column of x (1, or
// the row's scale) and of each W_g (b_g), padded to keep the rows 16-byte aligned.
std::pair<at::Tensor, at::Tensor> with_bias_column(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& bias,
                                                   const at::Tensor& scales) {
  const int64_t k = x.size(1), padded = (k + 1 + 7) / 8 * 8;
  auto xa = at::empty({x.size(0), padded}, x.options());
  auto wa = at::empty({weight.size(0), weight.size(1), padded}, weight.options());
  xa.narrow(1, 0, k).copy_(x);
  wa.narrow(2, 0, k).copy_(weight);
  if (scales.defined()) {
    xa.select(1, k).copy_(scales);
  } else {
    xa.select(1, k).fill_(1);
  }
  wa.select(2, k).copy_(bias);
  if (padded > k + 1) {
    xa.narrow(1, k + 1, padded - k - 1).zero_();
    wa.narrow(2, k + 1, padded - k - 1).zero_();
  }
  return {xa, wa};
}

at::Tensor grouped_linear_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& split_sizes,
                                   const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& scales) {
  constexpr const char* op = "grouped_linear_fwd";
  check_grouped_rows(op, "x", x, split_sizes);
  check_grouped_weight(op, "x", x, weight, split_sizes, 2);
  check_grouped_bias(op, x, weight, bias, scales);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), groups = weight.size(0), n = weight.size(1), k = weight.size(2);
  const auto table = group_table(op, split_sizes, rows);
  const auto xc = x.contiguous();
  at::Tensor bc, sc;
  if (bias.has_value()) bc = bias->contiguous();
  if (scales.has_value()) sc = scales->to(x.scalar_type()).contiguous();
  const auto offsets = table.narrow(0, 0, groups);
  if (use_grouped_mm(xc, weight.transpose(1, 2), groups)) {
    if (!bc.defined()) return at::_grouped_mm(xc, weight.transpose(1, 2), offsets);
    const auto [xa, wa] = with_bias_column(xc, weight, bc, sc);
    return at::_grouped_mm(xa, wa.transpose(1, 2), offsets);
  }
  auto y = at::empty({rows, n}, x.options());
  launch_grouped_rows_gemm(xc.const_data_ptr(), k, 1, weight.const_data_ptr(), weight.stride(0),
                           weight.stride(2), weight.stride(1), y.mutable_data_ptr(), rows, n, k,
                           bc.defined() ? bc.const_data_ptr() : nullptr,
                           sc.defined() ? sc.const_data_ptr() : nullptr,
                           table.const_data_ptr<int32_t>(), groups, kernel_dtype(op, x),
                           c10::cuda::getCurrentCUDAStream());
  return y;
}

at::Tensor grouped_linear_dgrad_cuda(const at::Tensor& dy, const at::Tensor& weight,
                                     const at::Tensor& split_sizes) {
  constexpr const char* op = "grouped_linear_dgrad";
  check_grouped_rows(op, "dy", dy, split_sizes);
  check_grouped_weight(op, "dy", dy, weight, split_sizes, 1);
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t rows = dy.size(0), groups = weight.size(0), n = weight.size(1), k = weight.size(2);
  const auto table = group_table(op, split_sizes, rows);
  const auto dyc = dy.contiguous();
  if (use_grouped_mm(dyc, weight, groups)) {
    return at::_grouped_mm(dyc, weight, table.narrow(0, 0, groups));
  }
  auto dx = at::empty({rows, k}, dy.options());
  launch_grouped_rows_gemm(dyc.const_data_ptr(), n, 1, weight.const_data_ptr(), weight.stride(0),
                           weight.stride(1), weight.stride(2), dx.mutable_data_ptr(), rows, k, n,
                           nullptr, nullptr, table.const_data_ptr<int32_t>(), groups,
                           kernel_dtype(op, dy), c10::cuda::getCurrentCUDAStream());
  return dx;
}

at::Tensor grouped_linear_wgrad_cuda(const at::Tensor& dy, const at::Tensor& x,
                                     const at::Tensor& split_sizes) {
  constexpr const char* op = "grouped_linear_wgrad";
  check_grouped_wgrad(op, dy, x, split_sizes);
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t rows = dy.size(0), groups = split_sizes.size(0), n = dy.size(1), k = x.size(1);
  const auto table = group_table(op, split_sizes, rows);
  const auto dyc = dy.contiguous();
  const auto xc = x.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto dyt = dyc.t();  // [N, rows]
  if (use_grouped_mm(dyt, xc, groups)) {
    auto dw = at::_grouped_mm(dyt, xc, table.narrow(0, 0, groups));
    launch_zero_empty_groups(dw.mutable_data_ptr(), table.const_data_ptr<int32_t>(), groups, n * k,
                             kernel_dtype(op, dy), stream);
    return dw;
  }
  auto dw = at::empty({groups, n, k}, dy.options());
  launch_grouped_wgrad_gemm(dyc.const_data_ptr(), xc.const_data_ptr(), dw.mutable_data_ptr(), rows,
                            n, k, table.const_data_ptr<int32_t>(), groups, kernel_dtype(op, dy),
                            stream);
  return dw;
}

std::tuple<at::Tensor, at::Tensor> grouped_bias_bwd_cuda(const at::Tensor& dy,
                                                         const at::Tensor& split_sizes,
                                                         const std::optional<at::Tensor>& scales,
                                                         const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "grouped_bias_bwd";
  check_grouped_bias_bwd(op, dy, split_sizes, scales, bias);
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t rows = dy.size(0), groups = split_sizes.size(0), cols = dy.size(1);
  const auto table = group_table(op, split_sizes, rows);
  const auto dyc = dy.contiguous();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto dtype = kernel_dtype(op, dy);
  const auto acc = acc_dtype(dy.scalar_type());
  at::Tensor sc;  // in the accumulation dtype, as the CPU reference reads them
  if (scales.has_value()) sc = scales->to(acc).contiguous();
  const auto* sc_ptr = sc.defined() ? sc.const_data_ptr() : nullptr;
  auto partial = at::empty({group_max_tiles(rows, groups), cols}, dy.options().dtype(acc));
  auto dbias = at::empty({groups, cols}, dy.options());
  launch_grouped_bias_grad(dyc.const_data_ptr(), sc_ptr, table.const_data_ptr<int32_t>(), groups,
                           rows, cols, partial.mutable_data_ptr(), dbias.mutable_data_ptr(), dtype,
                           stream);
  if (!bias.has_value()) return {dbias, at::empty({0}, dy.options().dtype(acc))};
  auto dscales = at::empty({rows}, dy.options().dtype(acc));
  const auto bc = bias->contiguous();
  launch_grouped_scale_grad(dyc.const_data_ptr(), bc.const_data_ptr(),
                            table.const_data_ptr<int32_t>(), groups, rows, cols,
                            dscales.mutable_data_ptr(), dtype, current_sm_count(), stream);
  return {dbias, dscales.to(scales->scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("grouped_linear_fwd", &grouped_linear_fwd_cuda);
  m.impl("grouped_linear_dgrad", &grouped_linear_dgrad_cuda);
  m.impl("grouped_linear_wgrad", &grouped_linear_wgrad_cuda);
  m.impl("grouped_bias_bwd", &grouped_bias_bwd_cuda);
}

}  // namespace fusible::kernels

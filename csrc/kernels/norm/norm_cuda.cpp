// LayerNorm / RMSNorm on CUDA (and their backward with the residual gradient added): torch-facing
// wrappers around norm_kernels.cu. A row too long for the kernels' shared memory, or statistics
// not in the accumulation dtype, runs the ATen reference instead. The compute dtype is weight's;
// a float32 x beside a bf16 / fp16 weight (autocast's residual stream) goes to the kernels as it
// is, other mixes are converted first (forward) or run the reference (backward).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <limits>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/dispatch.h"
#include "kernels/norm/norm.h"
#include "kernels/norm/norm_launchers.h"

namespace fusible::kernels {
namespace {

struct RowShape {
  int64_t rows, cols;
  std::vector<int64_t> stats;  // x's leading dims
};

RowShape row_shape(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t cols = weight.numel();
  auto lead = x.sizes().slice(0, x.dim() - weight.dim()).vec();
  return {cols == 0 ? 0 : x.numel() / cols, cols, std::move(lead)};
}

// Saved statistics as the kernels expect them: the compute dtype's accumulation dtype, one per
// row, on x's device.
bool stats_ok(const at::Tensor& stat, const at::Tensor& x, const at::Tensor& weight,
              const RowShape& s) {
  return stat.scalar_type() == acc_dtype(weight.scalar_type()) && stat.device() == x.device() &&
         stat.is_contiguous() && stat.numel() == s.rows;
}

// x as the forward kernels take it: as it is, or converted to weight's dtype first.
at::Tensor fwd_input(const at::Tensor& x, const at::Tensor& weight) {
  return norm_reads_as_is(x.scalar_type(), weight.scalar_type()) ? x : x.to(weight.scalar_type());
}

// Shapes the kernels take: a non-empty row (empty rows give NaN statistics, as the reference
// does) and a row count a grid dimension holds (one block per row: the forward, and the backward
// of rows too long for registers).
bool kernel_shape(const RowShape& s) {
  return s.cols > 0 && s.rows <= std::numeric_limits<int32_t>::max();
}

// norm_fwd and norm_bwd run under the wrapper's CUDAGuard, with s = row_shape(x, weight).
// -> (y, mean, rstd, amax: max |y| as [1] fp32 where with_amax, else undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(
    const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor* bias,
    double eps, bool zero_centered_gamma, const RowShape& s, bool with_amax = false) {
  const bool layernorm = bias != nullptr;
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const auto bc = layernorm ? bias->contiguous() : at::Tensor();
  auto y = at::empty(x.sizes(), weight.options());
  const auto stat_opts = x.options().dtype(acc_dtype(weight.scalar_type()));
  auto mean = layernorm ? at::empty(s.stats, stat_opts) : at::Tensor();
  auto rstd = at::empty(s.stats, stat_opts);
  auto amax = with_amax ? zeroed_amax(x.device()) : at::Tensor();
  launch_norm_fwd(xc.const_data_ptr(), wc.const_data_ptr(),
                  layernorm ? bc.const_data_ptr() : nullptr, y.mutable_data_ptr(),
                  layernorm ? mean.mutable_data_ptr() : nullptr, rstd.mutable_data_ptr(),
                  with_amax ? amax.mutable_data_ptr<float>() : nullptr, s.rows, s.cols, eps,
                  zero_centered_gamma, layernorm, kernel_dtype(op, weight), kernel_dtype(op, x),
                  c10::cuda::getCurrentCUDAStream());
  return {y, mean, rstd, amax};
}

// dx (+ dextra), dweight, dbias (LayerNorm: mean given).
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const char* op, const at::Tensor& dy, const at::Tensor& x, const at::Tensor* mean,
    const at::Tensor& rstd, const at::Tensor& weight, bool zero_centered_gamma,
    const at::Tensor* dextra, const RowShape& s) {
  const bool layernorm = mean != nullptr;
  const auto dtype = kernel_dtype(op, weight), x_dtype = kernel_dtype(op, x);
  const auto dyc = dy.contiguous(), xc = x.contiguous(), wc = weight.contiguous();
  const auto ec = dextra ? dextra->contiguous() : at::Tensor();
  auto dx = at::empty(x.sizes(), x.options());
  auto dw = at::empty(weight.sizes(), weight.options());
  auto db = layernorm ? at::empty(weight.sizes(), weight.options()) : at::Tensor();
  const int64_t chunks =
      norm_bwd_chunks(dyc.const_data_ptr(), xc.const_data_ptr(), wc.const_data_ptr(),
                      dextra ? ec.const_data_ptr() : nullptr, dx.const_data_ptr(), s.rows, s.cols,
                      layernorm, dtype, x_dtype, current_sm_count());
  const auto workspace = column_sum_workspace(chunks, 2 * s.cols, weight);
  launch_norm_bwd(
      dyc.const_data_ptr(), xc.const_data_ptr(), layernorm ? mean->const_data_ptr() : nullptr,
      rstd.const_data_ptr(), wc.const_data_ptr(), dextra ? ec.const_data_ptr() : nullptr,
      dx.mutable_data_ptr(), dw.mutable_data_ptr(), layernorm ? db.mutable_data_ptr() : nullptr,
      data_or_null(workspace), s.rows, s.cols, chunks, zero_centered_gamma, layernorm, dtype,
      x_dtype, c10::cuda::getCurrentCUDAStream());
  return {dx, dw, db};
}

// The forward kernels run for a non-empty row that fits their shared memory. Call under a
// CUDAGuard on x's device (norm_fits reads its limits).
bool fwd_runs(const char* op, const at::Tensor& weight, const RowShape& s) {
  return kernel_shape(s) && norm_fits(s.cols, kernel_dtype(op, weight), false, current_max_smem());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_cuda(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& bias,
                                                                  double eps,
                                                                  bool zero_centered_gamma) {
  reference::check_norm_args("layernorm_fwd", x, weight);
  reference::check_norm_bias("layernorm_fwd", x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!fwd_runs("layernorm_fwd", weight, s)) {
    return reference::layernorm_fwd(x, weight, bias, eps, zero_centered_gamma);
  }
  auto [y, mean, rstd, unused] =
      norm_fwd("layernorm_fwd", fwd_input(x, weight), weight, &bias, eps, zero_centered_gamma, s);
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    double eps, bool zero_centered_gamma) {
  reference::check_norm_args("rmsnorm_fwd", x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!fwd_runs("rmsnorm_fwd", weight, s)) {
    return reference::rmsnorm_fwd(x, weight, eps, zero_centered_gamma);
  }
  auto [y, mean, rstd, unused] =
      norm_fwd("rmsnorm_fwd", fwd_input(x, weight), weight, nullptr, eps, zero_centered_gamma, s);
  return {y, rstd};
}

// The forwards plus max |y| computed in the same pass (for an FP8 cast of y).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_amax_cuda(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    bool zero_centered_gamma) {
  reference::check_norm_args("layernorm_fwd_amax", x, weight);
  reference::check_norm_bias("layernorm_fwd_amax", x, weight, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!fwd_runs("layernorm_fwd_amax", weight, s)) {
    return reference::layernorm_fwd_amax(x, weight, bias, eps, zero_centered_gamma);
  }
  return norm_fwd("layernorm_fwd_amax", fwd_input(x, weight), weight, &bias, eps,
                  zero_centered_gamma, s, true);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd_amax_cuda(const at::Tensor& x,
                                                                     const at::Tensor& weight,
                                                                     double eps,
                                                                     bool zero_centered_gamma) {
  reference::check_norm_args("rmsnorm_fwd_amax", x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!fwd_runs("rmsnorm_fwd_amax", weight, s)) {
    return reference::rmsnorm_fwd_amax(x, weight, eps, zero_centered_gamma);
  }
  auto [y, mean, rstd, amax] = norm_fwd("rmsnorm_fwd_amax", fwd_input(x, weight), weight, nullptr,
                                        eps, zero_centered_gamma, s, true);
  return {y, rstd, amax};
}

// The backward kernels run when the row fits, the statistics are the forward's own, dy is in
// weight's dtype, x in a dtype they take beside it and dextra (when given) in x's dtype, shape
// and device. Else the reference. Call under a CUDAGuard on x's device (norm_fits reads its
// limits).
bool bwd_runs(const char* op, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
              const at::Tensor* dextra, const RowShape& s,
              std::initializer_list<const at::Tensor*> stats) {
  if (!kernel_shape(s) || dy.scalar_type() != weight.scalar_type()) return false;
  if (dextra != nullptr && (dextra->scalar_type() != x.scalar_type() ||
                            !dextra->sizes().equals(x.sizes()) || dextra->device() != x.device())) {
    return false;
  }
  for (const auto* st : stats) {
    if (!stats_ok(*st, x, weight, s)) return false;
  }
  return norm_reads_as_is(x.scalar_type(), weight.scalar_type()) &&
         norm_fits(s.cols, kernel_dtype(op, weight), true, current_max_smem());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma) {
  reference::check_norm_args("layernorm_bwd", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("layernorm_bwd", "dy", dy, x);
  FUSIBLE_CHECK_SAME_DEVICE("layernorm_bwd", "dy", dy, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!bwd_runs("layernorm_bwd", dy, x, weight, nullptr, s, {&mean, &rstd})) {
    return reference::layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma);
  }
  return norm_bwd("layernorm_bwd", dy, x, &mean, rstd, weight, zero_centered_gamma, nullptr, s);
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& rstd,
                                                    const at::Tensor& weight,
                                                    bool zero_centered_gamma) {
  reference::check_norm_args("rmsnorm_bwd", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("rmsnorm_bwd", "dy", dy, x);
  FUSIBLE_CHECK_SAME_DEVICE("rmsnorm_bwd", "dy", dy, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!bwd_runs("rmsnorm_bwd", dy, x, weight, nullptr, s, {&rstd})) {
    return reference::rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma);
  }
  auto [dx, dw, db] =
      norm_bwd("rmsnorm_bwd", dy, x, nullptr, rstd, weight, zero_centered_gamma, nullptr, s);
  return {dx, dw};
}

// The fused residual-gradient twins: dextra added in the kernel's last pass.
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& rstd,
                                                        const at::Tensor& weight,
                                                        bool zero_centered_gamma,
                                                        const at::Tensor& dextra) {
  reference::check_norm_args("rmsnorm_bwd_add", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("rmsnorm_bwd_add", "dy", dy, x);
  FUSIBLE_CHECK_SAME_DEVICE("rmsnorm_bwd_add", "dy", dy, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!bwd_runs("rmsnorm_bwd_add", dy, x, weight, &dextra, s, {&rstd})) {
    return reference::rmsnorm_bwd_add(dy, x, rstd, weight, zero_centered_gamma, dextra);
  }
  auto [dx, dw, db] =
      norm_bwd("rmsnorm_bwd_add", dy, x, nullptr, rstd, weight, zero_centered_gamma, &dextra, s);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra) {
  reference::check_norm_args("layernorm_bwd_add", x, weight);
  FUSIBLE_CHECK_SHAPE_LIKE("layernorm_bwd_add", "dy", dy, x);
  FUSIBLE_CHECK_SAME_DEVICE("layernorm_bwd_add", "dy", dy, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto s = row_shape(x, weight);
  if (!bwd_runs("layernorm_bwd_add", dy, x, weight, &dextra, s, {&mean, &rstd})) {
    return reference::layernorm_bwd_add(dy, x, mean, rstd, weight, zero_centered_gamma, dextra);
  }
  return norm_bwd("layernorm_bwd_add", dy, x, &mean, rstd, weight, zero_centered_gamma, &dextra, s);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("layernorm_fwd", &layernorm_fwd_cuda);
  m.impl("layernorm_bwd", &layernorm_bwd_cuda);
  m.impl("rmsnorm_fwd", &rmsnorm_fwd_cuda);
  m.impl("rmsnorm_bwd", &rmsnorm_bwd_cuda);
  m.impl("layernorm_fwd_amax", &layernorm_fwd_amax_cuda);
  m.impl("rmsnorm_fwd_amax", &rmsnorm_fwd_amax_cuda);
  m.impl("rmsnorm_bwd_add", &rmsnorm_bwd_add_cuda);
  m.impl("layernorm_bwd_add", &layernorm_bwd_add_cuda);
}

}  // namespace fusible::kernels

// fp8_quantize_dequantize(_delayed), fp8_cast(_with_amax, _delayed) and fp8_cast_grouped on CUDA:
// wrappers around fp8_kernels.cu (a cast: a memset and two kernels, plus one for the
// delayed-scaling update, or for a small tensor with fp8_cast_one_launch on, one launch; two
// kernels for all groups of a grouped cast).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "kernels/common/carved_tensor.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/fp8/fp8.h"
#include "kernels/fp8/fp8_launchers.h"

namespace fusible::kernels {
namespace {

at::Tensor qdq(const at::Tensor& x, c10::string_view format, double margin,
               const at::Tensor* history, const at::Tensor* scale, bool use_max) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  auto amax = at::empty({1}, x.options().dtype(at::kFloat));
  launch_fp8_qdq(xc.const_data_ptr(), y.mutable_data_ptr(), x.numel(), format == "e4m3", margin,
                 amax.mutable_data_ptr<float>(), scale ? scale->mutable_data_ptr<float>() : nullptr,
                 history ? history->mutable_data_ptr<float>() : nullptr,
                 history ? history->size(0) : 0, use_max,
                 kernel_dtype("fp8_quantize_dequantize", x), current_sm_count(),
                 c10::cuda::getCurrentCUDAStream());
  return y;
}

at::Tensor fp8_qdq_cuda(const at::Tensor& x, c10::string_view format, double margin) {
  check_fp8_qdq_args(x, format, margin);
  // The kernels keep amax and scale in fp32; fp64 (a reference, not a speed path) stays exact.
  if (x.scalar_type() == at::kDouble) return reference::fp8_quantize_dequantize(x, format, margin);
  return qdq(x, format, margin, nullptr, nullptr, false);
}

at::Tensor fp8_qdq_delayed_cuda(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax_history, const at::Tensor& scale,
                                double margin, c10::string_view amax_compute_algo) {
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  // fp64, or state the kernels cannot write through raw pointers: the ATen path.
  if (x.scalar_type() == at::kDouble || amax_history.numel() < 1 || scale.numel() != 1 ||
      !amax_history.is_contiguous()) {
    return reference::fp8_quantize_dequantize_delayed(x, format, amax_history, scale, margin,
                                                      amax_compute_algo);
  }
  return qdq(x, format, margin, &amax_history, &scale, amax_compute_algo == "max");
}

// The cast kernel's conditions: fp32 / bf16 / fp16, rows of whole 4-element vectors (and, for the
// transpose, a row count that is a multiple of 4), 16-byte aligned.
bool cast_kernel_runs(const at::Tensor& x, bool transpose) {
  const auto t = x.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return false;
  const int64_t cols = x.size(-1), rows = leading_rows(x);
  return cols % 4 == 0 && (!transpose || rows % 4 == 0) &&
         reinterpret_cast<std::uintptr_t>(x.const_data_ptr()) % 16 == 0;
}

// At most this many elements (and with fp8_cast_one_launch on), a cast computing its own amax
// takes one launch, with scale_inv and the scratch in one allocation: a small tensor's cast costs
// its host calls, not its bytes. (Each output keeps a storage of its own: outputs sharing one
// would alias in the op's schema.)
constexpr int64_t kOneLaunchMaxElements = int64_t{1} << 22;

// x: contiguous, and passing cast_kernel_runs.
// amax_given: amax(x) as the kernel that wrote x computed it (current scaling, no amax pass).
// act: an activation applied on load (16-bit x; fp8.h's cast_activation).
Fp8Cast cast(const at::Tensor& x, c10::string_view format, double margin, bool transpose,
             const at::Tensor* history, const at::Tensor* scale, bool use_max,
             const at::Tensor* amax_given = nullptr, std::optional<ActKind> act = std::nullopt) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = leading_rows(x), n = x.numel();
  const auto fp8 = fp8_dtype("fp8_cast", format);
  const std::vector<int64_t> t_shape =
      transpose ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{0};
  auto data = at::empty(x.sizes(), x.options().dtype(fp8));
  auto data_t = at::empty(t_shape, data.options());
  at::Tensor scale_inv, amax;
  float* amax_ptr = nullptr;
  float* partial = nullptr;  // the one-launch kernel's scratch
  const int sms = current_sm_count();
  if (fp8_cast_one_launch() && amax_given == nullptr && n > 0 && n <= kOneLaunchMaxElements) {
    // [scale_inv, 16-byte aligned as cuBLASLt takes scale pointers | amax | a partial amax per
    // block]: scale_inv is carved out, the rest is scratch.
    const int64_t blocks = fp8_cast_one_launch_blocks(rows, cols, sms);
    auto buffer = at::empty({5 + blocks}, x.options().dtype(at::kFloat));
    scale_inv = carve(buffer, 0, {1}, at::kFloat);
    amax_ptr = buffer.mutable_data_ptr<float>() + 4;
    partial = amax_ptr + 1;
  } else {
    scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
    if (amax_given == nullptr) {
      amax = at::empty({1}, x.options().dtype(at::kFloat));
      amax_ptr = amax.mutable_data_ptr<float>();
    }
  }
  // Read only where given (the kernels write *amax only while they compute it).
  if (amax_given != nullptr) {
    amax = amax_given->contiguous();
    amax_ptr = static_cast<float*>(amax.data_ptr());
  }
  launch_fp8_cast(
      x.const_data_ptr(), data.mutable_data_ptr(), transpose ? data_t.mutable_data_ptr() : nullptr,
      rows, cols, format == "e4m3", margin, amax_ptr, amax_given != nullptr,
      scale ? scale->mutable_data_ptr<float>() : nullptr, scale_inv.mutable_data_ptr<float>(),
      history ? history->mutable_data_ptr<float>() : nullptr, history ? history->size(0) : 0,
      use_max, kernel_dtype("fp8_cast", x), sms, c10::cuda::getCurrentCUDAStream(),
      act ? &*act : nullptr, partial);
  return {data, data_t, scale_inv};
}

// The kernels apply an activation on load to 16-bit data only.
bool act_runs(const at::Tensor& x, const std::optional<ActKind>& act) {
  return !act || x.element_size() == 2;
}

Fp8Cast fp8_cast_cuda(const at::Tensor& x, c10::string_view format, double margin, bool transpose,
                      c10::string_view act) {
  check_fp8_cast_args("fp8_cast", x, format, margin);
  const auto kind = cast_activation("fp8_cast", act);
  const auto xc = x.contiguous();
  if (!cast_kernel_runs(xc, transpose) || !act_runs(xc, kind)) {
    return reference::fp8_cast(x, format, margin, transpose, act);
  }
  return cast(xc, format, margin, transpose, nullptr, nullptr, false, nullptr, kind);
}

Fp8Cast fp8_cast_with_amax_cuda(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax, double margin, bool transpose) {
  check_fp8_cast_args("fp8_cast_with_amax", x, format, margin);
  check_fp8_amax_arg("fp8_cast_with_amax", x, amax);
  const auto xc = x.contiguous();
  if (!cast_kernel_runs(xc, transpose)) {
    return reference::fp8_cast_with_amax(x, format, amax, margin, transpose);
  }
  return cast(xc, format, margin, transpose, nullptr, nullptr, false, &amax);
}

Fp8Cast fp8_cast_delayed_cuda(const at::Tensor& x, c10::string_view format,
                              const at::Tensor& amax_history, const at::Tensor& scale,
                              double margin, c10::string_view amax_compute_algo, bool transpose,
                              c10::string_view act) {
  check_fp8_cast_args("fp8_cast_delayed", x, format, margin);
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  const auto kind = cast_activation("fp8_cast_delayed", act);
  const auto xc = x.contiguous();
  if (!cast_kernel_runs(xc, transpose) || !act_runs(xc, kind) || amax_history.numel() < 1 ||
      scale.numel() != 1 || !amax_history.is_contiguous()) {
    return reference::fp8_cast_delayed(x, format, amax_history, scale, margin, amax_compute_algo,
                                       transpose, act);
  }
  return cast(xc, format, margin, transpose, &amax_history, &scale, amax_compute_algo == "max",
              nullptr, kind);
}

Fp8Cast fp8_cast_grouped_cuda(const at::Tensor& x, at::IntArrayRef sizes, c10::string_view format,
                              double margin, bool transpose) {
  check_fp8_cast_grouped_args(x, sizes, format, margin);
  const auto xc = x.contiguous();
  bool runs = xc.numel() > 0 && cast_kernel_runs(xc, false);  // (no rows or columns: ATen)
  for (const auto m : sizes) runs = runs && (!transpose || m % 4 == 0);
  if (!runs) return reference::fp8_cast_grouped(x, sizes, format, margin, transpose);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto n = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> row_start(n + 1, 0);
  for (int64_t g = 0; g < n; ++g) row_start[g + 1] = row_start[g] + sizes[g];
  auto data = at::empty(xc.sizes(), xc.options().dtype(fp8_dtype("fp8_cast_grouped", format)));
  auto data_t = at::empty({transpose ? xc.numel() : 0}, data.options());
  auto amax = at::empty({n}, xc.options().dtype(at::kFloat));
  auto scale_inv = at::empty({n}, amax.options());
  launch_fp8_cast_grouped(xc.const_data_ptr(), data.mutable_data_ptr(),
                          transpose ? data_t.mutable_data_ptr() : nullptr, row_start.data(), n,
                          xc.size(1), format == "e4m3", margin, amax.mutable_data_ptr<float>(),
                          scale_inv.mutable_data_ptr<float>(), kernel_dtype("fp8_cast_grouped", xc),
                          c10::cuda::getCurrentCUDAStream());
  return {data, data_t, scale_inv};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("fp8_cast_grouped", &fp8_cast_grouped_cuda);
  m.impl("fp8_quantize_dequantize", &fp8_qdq_cuda);
  m.impl("fp8_quantize_dequantize_delayed", &fp8_qdq_delayed_cuda);
  m.impl("fp8_cast", &fp8_cast_cuda);
  m.impl("fp8_cast_with_amax", &fp8_cast_with_amax_cuda);
  m.impl("fp8_cast_delayed", &fp8_cast_delayed_cuda);
}

}  // namespace fusible::kernels

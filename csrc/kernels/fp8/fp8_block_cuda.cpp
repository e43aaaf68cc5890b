// fp8_cast_block on CUDA: one kernel (fp8_block_kernels.cu) for bf16 / fp16 tensors whose rows
// are whole 16-byte vectors (partial 128x128 tiles included); other shapes and dtypes take the ATen
// version.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels/common/cuda_dtype.h"
#include "kernels/fp8/fp8.h"
#include "kernels/fp8/fp8_block.h"
#include "kernels/fp8/fp8_launchers.h"

namespace fusible::kernels {
namespace {

Fp8BlockCast fp8_cast_block_cuda(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                                 bool rowwise, bool columnwise, c10::string_view act) {
  check_fp8_cast_block_args(x, format, block_dim, rowwise, columnwise);
  const auto kind = cast_activation("fp8_cast_block", act);
  const int64_t cols = x.size(-1), rows = cols > 0 ? x.numel() / cols : 0;
  const auto t = x.scalar_type();
  const auto xc = x.contiguous();
  const bool aligned = reinterpret_cast<std::uintptr_t>(xc.const_data_ptr()) % 16 == 0;
  if ((t != at::kBFloat16 && t != at::kHalf) || rows == 0 || cols % 8 != 0 ||
      (columnwise && rows % 8 != 0) || !aligned) {
    return reference::fp8_cast_block(x, format, block_dim, rowwise, columnwise, act);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto fp8 = x.options().dtype(fp8_dtype("fp8_cast_block", format));
  const auto f32 = x.options().dtype(at::kFloat);
  auto data = rowwise ? at::empty(x.sizes(), fp8) : at::empty({0}, fp8);
  auto data_t = columnwise ? at::empty({cols, rows}, fp8) : at::empty({0}, fp8);
  // The kernel writes every entry of the scale layouts, their zero padding too.
  auto scale_inv =
      rowwise ? at::empty(block_scale_shape(rows, cols, block_dim), f32) : at::empty({0}, f32);
  auto scale_inv_t =
      columnwise ? at::empty(block_scale_shape(cols, rows, block_dim), f32) : at::empty({0}, f32);
  launch_fp8_cast_block(xc.const_data_ptr(), rowwise ? data.mutable_data_ptr() : nullptr,
                        rowwise ? scale_inv.mutable_data_ptr<float>() : nullptr,
                        columnwise ? data_t.mutable_data_ptr() : nullptr,
                        columnwise ? scale_inv_t.mutable_data_ptr<float>() : nullptr, rows, cols,
                        block_dim, format == "e4m3", kernel_dtype("fp8_cast_block", x),
                        c10::cuda::getCurrentCUDAStream(), kind ? &*kind : nullptr);
  return {data, scale_inv, data_t, scale_inv_t};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) { m.impl("fp8_cast_block", &fp8_cast_block_cuda); }

}  // namespace fusible::kernels

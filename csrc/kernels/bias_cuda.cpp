// bias_fwd / bias_bwd on CUDA: torch-facing wrappers around the raw kernels in bias_kernels.cu.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/bias.h"
#include "kernels/cuda_device.h"
#include "kernels/cuda_dtype.h"
#include "kernels/cuda_launchers.h"

namespace fusible::kernels {
namespace {

at::Tensor bias_fwd_cuda(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_fwd_args(x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  launch_bias_fwd(xc.const_data_ptr(), bc.const_data_ptr(), y.mutable_data_ptr(), rows, cols,
                  kernel_dtype("bias_fwd", x), current_sm_count(),
                  c10::cuda::getCurrentCUDAStream());
  return y;
}

at::Tensor bias_bwd_cuda(const at::Tensor& dy) {
  check_bias_bwd_args(dy);
  const c10::cuda::CUDAGuard guard(dy.device());
  const auto dyc = dy.contiguous();
  const int64_t cols = dy.size(-1);
  const int64_t rows = cols == 0 ? 0 : dy.numel() / cols;
  const auto dtype = kernel_dtype("bias_bwd", dy);
  const int64_t chunks = bias_bwd_num_chunks(rows, cols, current_sm_count());
  const auto acc = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto workspace = at::empty({chunks, cols}, dy.options().dtype(acc));
  auto dbias = at::empty({cols}, dy.options());
  launch_bias_bwd(dyc.const_data_ptr(), workspace.mutable_data_ptr(), dbias.mutable_data_ptr(),
                  rows, cols, chunks, dtype, c10::cuda::getCurrentCUDAStream());
  return dbias;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("bias_fwd", &bias_fwd_cuda);
  m.impl("bias_bwd", &bias_bwd_cuda);
}

}  // namespace fusible::kernels

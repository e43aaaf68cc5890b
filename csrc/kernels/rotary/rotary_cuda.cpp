// qkv_rotary_fwd / qkv_rotary_bwd on CUDA: torch-facing wrappers around rotary_kernels.cu.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/rotary/rotary.h"
#include "kernels/rotary/rotary_launchers.h"

namespace fusible::kernels {
namespace {

// A cos / sin table as the kernels read it: contiguous, in the data's accumulation type.
at::Tensor table(const at::Tensor& t, at::ScalarType data_dtype) {
  return t.to(acc_dtype(data_dtype)).contiguous();
}

at::Tensor qkv_rotary_fwd_cuda(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t num_heads) {
  reference::check_qkv_rotary_fwd_args(qkv, cos, sin, num_heads);
  const c10::cuda::CUDAGuard guard(qkv.device());
  const auto x = qkv.contiguous();
  const QkvShape shape{x.size(0), x.size(1), num_heads, x.size(2) / (3 * num_heads)};
  auto out = at::empty({shape.batch, shape.seq, 2, num_heads, shape.head_dim}, x.options());
  const auto c = table(cos, x.scalar_type()), s = table(sin, x.scalar_type());
  launch_qkv_rotary_fwd(x.const_data_ptr(), c.const_data_ptr(), s.const_data_ptr(),
                        out.mutable_data_ptr(), shape, kernel_dtype("qkv_rotary_fwd", x),
                        current_sm_count(), c10::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor qkv_rotary_bwd_cuda(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                               const at::Tensor& cos, const at::Tensor& sin) {
  reference::check_qkv_rotary_bwd_args(dq, dk, dv, cos, sin);
  const c10::cuda::CUDAGuard guard(dq.device());
  // Any strides but a contiguous last dim (SDPA's gradients come as views of [b, s, h, d]).
  const at::Tensor g[3] = {dq.stride(3) == 1 ? dq : dq.contiguous(),
                           dk.stride(3) == 1 ? dk : dk.contiguous(),
                           dv.stride(3) == 1 ? dv : dv.contiguous()};
  QkvGrads grads;
  for (int i = 0; i < 3; ++i) {
    grads.data[i] = g[i].const_data_ptr();
    grads.batch_stride[i] = g[i].stride(0);
    grads.head_stride[i] = g[i].stride(1);
    grads.seq_stride[i] = g[i].stride(2);
  }
  const QkvShape shape{dq.size(0), dq.size(2), dq.size(1), dq.size(3)};
  auto dqkv = at::empty({shape.batch, shape.seq, 3 * shape.heads * shape.head_dim}, dq.options());
  const auto c = table(cos, dq.scalar_type()), s = table(sin, dq.scalar_type());
  launch_qkv_rotary_bwd(grads, c.const_data_ptr(), s.const_data_ptr(), dqkv.mutable_data_ptr(),
                        shape, kernel_dtype("qkv_rotary_bwd", dq), current_sm_count(),
                        c10::cuda::getCurrentCUDAStream());
  return dqkv;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("qkv_rotary_fwd", &qkv_rotary_fwd_cuda);
  m.impl("qkv_rotary_bwd", &qkv_rotary_bwd_cuda);
}

}  // namespace fusible::kernels

// scale_fwd / add_fwd / add_ on CUDA: torch-facing wrappers around elementwise_kernels.cu. Mixed
// dtypes in an add run the ATen reference (it rounds once, from fp32; with x the wider, one
// promoting ATen add).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/elementwise/elementwise.h"
#include "kernels/elementwise/elementwise_launchers.h"

namespace fusible::kernels {
namespace {

at::Tensor scale_fwd_cuda(const at::Tensor& x, double scale) {
  FUSIBLE_CHECK_FLOATING("scale_fwd", "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  launch_scale(xc.const_data_ptr(), y.mutable_data_ptr(), x.numel(), scale,
               kernel_dtype("scale_fwd", x), current_sm_count(), c10::cuda::getCurrentCUDAStream());
  return y;
}

at::Tensor add_fwd_cuda(const at::Tensor& x, const at::Tensor& other) {
  reference::check_add_args("add_fwd", x, other);
  if (other.scalar_type() != x.scalar_type()) return reference::add_fwd(x, other);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous(), oc = other.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  launch_add(xc.const_data_ptr(), oc.const_data_ptr(), y.mutable_data_ptr(), x.numel(),
             kernel_dtype("add_fwd", x), current_sm_count(), c10::cuda::getCurrentCUDAStream());
  return y;
}

void add__cuda(const at::Tensor& self, const at::Tensor& other) {
  reference::check_add_args("add_", self, other);
  // Mixed dtypes, a strided self, or an other overlapping self at an offset: ATen's add_.
  if (other.scalar_type() != self.scalar_type() || !self.is_contiguous() ||
      (other.is_alias_of(self) && other.const_data_ptr() != self.const_data_ptr())) {
    return reference::add_(self, other);
  }
  const c10::cuda::CUDAGuard guard(self.device());
  const auto oc = other.contiguous();
  launch_add(self.const_data_ptr(), oc.const_data_ptr(), self.mutable_data_ptr(), self.numel(),
             kernel_dtype("add_", self), current_sm_count(), c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("scale_fwd", &scale_fwd_cuda);
  m.impl("add_fwd", &add_fwd_cuda);
  m.impl("add_", &add__cuda);
}

}  // namespace fusible::kernels

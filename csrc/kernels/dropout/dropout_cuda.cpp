// dropout_fwd / dropout_bwd on CUDA: torch-facing wrappers around dropout_kernels.cu, seeded from
// PyTorch's CUDA generator (so torch.manual_seed and CUDA-graph capture apply).
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <mutex>

#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/dropout/dropout.h"
#include "kernels/dropout/dropout_launchers.h"

namespace fusible::kernels {
namespace {

PhiloxSeed next_philox(uint64_t increment) {
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState state;
  {
    const std::lock_guard<std::mutex> lock(gen->mutex_);
    state = gen->philox_cuda_state(increment);
  }
  PhiloxSeed seed;
  if (state.captured_) {
    seed.seed_ptr = state.seed_.ptr;
    seed.offset_ptr = state.offset_.ptr;
    seed.offset = state.offset_intragraph_;
  } else {
    seed.seed = state.seed_.val;
    seed.offset = state.offset_.val;
  }
  return seed;
}

std::tuple<at::Tensor, at::Tensor> dropout_fwd_cuda(const at::Tensor& x, double p) {
  reference::check_dropout_fwd_args(x, p);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const int64_t n = x.numel();
  auto y = at::empty(x.sizes(), x.options());
  auto mask = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
  const auto plan = dropout_fwd_plan(n, current_sm_count());
  launch_dropout_fwd(xc.const_data_ptr(), y.mutable_data_ptr(), mask.mutable_data_ptr(), n, p, plan,
                     next_philox(plan.offset_increment), kernel_dtype("dropout_fwd", x),
                     c10::cuda::getCurrentCUDAStream());
  return {y, mask};
}

at::Tensor dropout_bwd_cuda(const at::Tensor& dy, const at::Tensor& mask, double p) {
  reference::check_dropout_bwd_args(dy, mask);
  const c10::cuda::CUDAGuard guard(dy.device());
  const auto dyc = dy.contiguous(), mc = mask.contiguous();
  auto dx = at::empty(dy.sizes(), dy.options());
  launch_dropout_bwd(dyc.const_data_ptr(), mc.const_data_ptr(), dx.mutable_data_ptr(), dy.numel(),
                     p, kernel_dtype("dropout_bwd", dy), current_sm_count(),
                     c10::cuda::getCurrentCUDAStream());
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("dropout_fwd", &dropout_fwd_cuda);
  m.impl("dropout_bwd", &dropout_bwd_cuda);
}

}  // namespace fusible::kernels

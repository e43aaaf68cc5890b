// Facts about the current CUDA device that the kernel launchers size their grids by.
#pragma once

#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace fusible::kernels {

/// Streaming multiprocessors of the current device (read from the device, cached by PyTorch).
inline int current_sm_count() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

/// Shared memory one block may opt in to on the current device (cached by PyTorch).
inline int current_max_smem() {
  return static_cast<int>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
}

/// The current device's compute capability major version (9: Hopper, 10: Blackwell).
inline int current_sm_major() { return at::cuda::getCurrentDeviceProperties()->major; }

/// A [1] fp32 amax on `device`, zeroed on the current stream for a kernel that max-reduces into
/// it: a memset, not at::zeros (a dispatched fill and its launch, on every FP8 cast's host path).
inline at::Tensor zeroed_amax(const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  auto amax = at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  C10_CUDA_CHECK(cudaMemsetAsync(amax.mutable_data_ptr(), 0, sizeof(float),
                                 c10::cuda::getCurrentCUDAStream()));
  return amax;
}

}  // namespace fusible::kernels

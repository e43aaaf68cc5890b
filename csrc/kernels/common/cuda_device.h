// Facts about the current CUDA device that the kernel launchers size their grids by.
#pragma once

#include <ATen/cuda/CUDAContextLight.h>

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

}  // namespace fusible::kernels

// Host launchers of the dropout family's raw kernels (dropout_kernels.cu). The keep-mask is bits:
// element e is bit e % 8 of byte e / 8.
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// Philox seed and offset from PyTorch's CUDA generator; under CUDA-graph capture, device pointers
/// read at replay (seed_ptr, offset_ptr, plus offset as the in-graph increment).
struct PhiloxSeed {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
};

/// The forward's grid and how far each thread advances the generator (the offset increment).
struct DropoutLaunch {
  int64_t blocks = 0;
  uint64_t offset_increment = 0;
};
DropoutLaunch dropout_fwd_plan(int64_t n, int num_sms);

/// y = x * keep / (1 - p) with keep ~ Bernoulli(1 - p), mask (ceil(n / 8) bytes) the keep bits.
void launch_dropout_fwd(const void* x, void* y, void* mask, int64_t n, double p,
                        const DropoutLaunch& plan, const PhiloxSeed& rng, KernelDType dtype,
                        cudaStream_t stream);
/// dx = dy * keep / (1 - p) from the mask's bits.
void launch_dropout_bwd(const void* dy, const void* mask, void* dx, int64_t n, double p,
                        KernelDType dtype, int num_sms, cudaStream_t stream);

}  // namespace fusible::kernels

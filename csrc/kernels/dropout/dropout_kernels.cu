// Dropout with Philox random numbers (cuRAND's device generator, seeded from PyTorch's CUDA
// generator) and the keep-mask stored as bits: one thread per mask byte, i.e. per 8 elements.
#include <curand_kernel.h>

#include "kernels/common/cuda_common.cuh"
#include "kernels/dropout/dropout_launchers.h"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

__device__ __forceinline__ void philox_seed_offset(const PhiloxSeed& rng, uint64_t& seed,
                                                   uint64_t& offset) {
  if (rng.seed_ptr != nullptr) {  // captured in a CUDA graph: read at replay time
    seed = static_cast<uint64_t>(*rng.seed_ptr);
    offset = static_cast<uint64_t>(*rng.offset_ptr) + rng.offset;
  } else {
    seed = rng.seed;
    offset = rng.offset;
  }
}

template <typename T>
__global__ void dropout_fwd_kernel(const T* __restrict__ x, T* __restrict__ y,
                                   uint8_t* __restrict__ mask, int64_t n, float keep_prob,
                                   acc_t<T> scale, PhiloxSeed rng) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  uint64_t seed, offset;
  philox_seed_offset(rng, seed, offset);
  curandStatePhilox4_32_10_t state;
  curand_init(seed, tid, offset, &state);
  const int64_t bytes = (n + 7) / 8;
  for (int64_t b = tid; b < bytes; b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 r0 = curand_uniform4(&state);
    const float4 r1 = curand_uniform4(&state);
    const float r[8] = {r0.x, r0.y, r0.z, r0.w, r1.x, r1.y, r1.z, r1.w};
    uint8_t bits = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t e = b * 8 + j;
      if (e < n) {
        const bool keep = r[j] <= keep_prob;  // uniform in (0, 1]: keep_prob 1 keeps all
        bits |= static_cast<uint8_t>(keep) << j;
        y[e] = from_acc<T>(keep ? to_acc(x[e]) * scale : acc_t<T>(0));
      }
    }
    mask[b] = bits;
  }
}

template <typename T>
__global__ void dropout_bwd_kernel(const T* __restrict__ dy, const uint8_t* __restrict__ mask,
                                   T* __restrict__ dx, int64_t n, acc_t<T> scale) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool keep = (mask[e / 8] >> (e % 8)) & 1;
    dx[e] = from_acc<T>(keep ? to_acc(dy[e]) * scale : acc_t<T>(0));
  }
}

constexpr int kThreads = 256;

}  // namespace

DropoutLaunch dropout_fwd_plan(int64_t n, int num_sms) {
  const int64_t bytes = (n + 7) / 8;
  const int64_t blocks = cuda::grid_for(bytes, kThreads, num_sms);
  const int64_t threads = blocks * kThreads;
  const int64_t per_thread = (bytes + threads - 1) / threads;
  return {blocks, static_cast<uint64_t>(per_thread * 8)};  // 8 random numbers per byte
}

void launch_dropout_fwd(const void* x, void* y, void* mask, int64_t n, double p,
                        const DropoutLaunch& plan, const PhiloxSeed& rng, KernelDType dtype,
                        cudaStream_t stream) {
  if (n == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A scale = p < 1 ? A(1) / (A(1) - static_cast<A>(p)) : A(0);
    dropout_fwd_kernel<T><<<plan.blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), static_cast<uint8_t*>(mask), n,
        static_cast<float>(1 - p), scale, rng);
  });
  cuda::check_launch("dropout_fwd_kernel");
}

void launch_dropout_bwd(const void* dy, const void* mask, void* dx, int64_t n, double p,
                        KernelDType dtype, int num_sms, cudaStream_t stream) {
  if (n == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const A scale = p < 1 ? A(1) / (A(1) - static_cast<A>(p)) : A(0);
    dropout_bwd_kernel<T><<<cuda::grid_for(n, kThreads, num_sms), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const uint8_t*>(mask), static_cast<T*>(dx), n,
        scale);
  });
  cuda::check_launch("dropout_bwd_kernel");
}

}  // namespace fusible::kernels

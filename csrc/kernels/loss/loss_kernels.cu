// Softmax cross-entropy, one block per row: the forward streams the row once with a running
// (max, sum of exp) per thread, merged across the block; the backward streams it again and writes
// (softmax - onehot) * dloss. Logits are read in their own dtype (16-byte vectors where the row
// allows), math in fp32 (fp64 for fp64).
#include <cmath>

#include "kernels/common/cuda_common.cuh"
#include "kernels/loss/loss_launchers.h"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

__device__ __forceinline__ float exp_acc(float v) { return __expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }
__device__ __forceinline__ float log_acc(float v) { return __logf(v); }
__device__ __forceinline__ double log_acc(double v) { return log(v); }

// (m, s) <- the pair for the union of both sets: max and sum of exp(x - max).
template <typename A>
__device__ __forceinline__ void merge(A& m, A& s, A m2, A s2) {
  const A top = m > m2 ? m : m2;
  if (top == -INFINITY) return;  // both empty (or all -inf): nothing to add
  s = s * exp_acc(m - top) + s2 * exp_acc(m2 - top);
  m = top;
}

// The block's merged (max, sum); every thread gets it.
template <typename A>
__device__ __forceinline__ void block_merge(A& m, A& s) {
  __shared__ A scratch_m[32], scratch_s[32];
  for (int o = 16; o > 0; o /= 2) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch_m[warp] = m;
    scratch_s[warp] = s;
  }
  __syncthreads();
  const int warps = blockDim.x / 32;
  m = lane < warps ? scratch_m[lane] : A(-INFINITY);
  s = lane < warps ? scratch_s[lane] : A(0);
  for (int o = 16; o > 0; o /= 2) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  }
}

template <typename T, int VEC>
__global__ void cross_entropy_fwd_kernel(const T* __restrict__ logits,
                                         const int64_t* __restrict__ targets,
                                         acc_t<T>* __restrict__ loss, acc_t<T>* __restrict__ stats,
                                         int64_t classes, int64_t ignore_index) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * classes;
  A m = -INFINITY, s = 0;
  for (int64_t c = threadIdx.x * static_cast<int64_t>(VEC); c < classes;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    T v[VEC];
    cuda::load_elements<(VEC > 1)>(x + c, v);
    A chunk_max = to_acc(v[0]);
#pragma unroll
    for (int e = 1; e < VEC; ++e) chunk_max = fmax(chunk_max, to_acc(v[e]));
    if (chunk_max == -INFINITY) continue;
    A chunk_sum = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) chunk_sum += exp_acc(to_acc(v[e]) - chunk_max);
    merge(m, s, chunk_max, chunk_sum);
  }
  block_merge(m, s);
  if (threadIdx.x == 0) {
    const A log_sum = log_acc(s);
    const int64_t t = targets[row];
    stats[2 * row] = m;
    stats[2 * row + 1] = log_sum;
    if (t == ignore_index) {
      loss[row] = A(0);
    } else if (t < 0 || t >= classes) {
      loss[row] = A(NAN);  // out of range: a visible NaN (the CPU reference raises)
    } else {
      loss[row] = (m - to_acc(x[t])) + log_sum;  // exact for large logits, unlike lse - x[t]
    }
  }
}

template <typename T, int VEC>
__global__ void cross_entropy_bwd_kernel(const acc_t<T>* __restrict__ dloss,
                                         const T* __restrict__ logits,
                                         const int64_t* __restrict__ targets,
                                         const acc_t<T>* __restrict__ stats,
                                         T* __restrict__ dlogits, int64_t classes,
                                         int64_t ignore_index) {
  using A = acc_t<T>;
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  const A g = t == ignore_index ? A(0) : dloss[row];
  const A m = stats[2 * row], log_sum = stats[2 * row + 1];
  const T* x = logits + row * classes;
  T* dx = dlogits + row * classes;
  for (int64_t c = threadIdx.x * static_cast<int64_t>(VEC); c < classes;
       c += static_cast<int64_t>(blockDim.x) * VEC) {
    T v[VEC];
    cuda::load_elements<(VEC > 1)>(x + c, v);
    cuda::Vec<T, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const A p = exp_acc((to_acc(v[e]) - m) - log_sum) - (c + e == t ? A(1) : A(0));
      out.v[e] = from_acc<T>(p * g);
    }
    if constexpr (VEC > 1) {
      cuda::store_vec<T, VEC>(dx + c, out);
    } else {
      dx[c] = out.v[0];
    }
  }
}

constexpr int kThreads = 256;

}  // namespace

void launch_cross_entropy_fwd(const void* logits, const int64_t* targets, void* loss, void* stats,
                              int64_t rows, int64_t classes, int64_t ignore_index,
                              KernelDType dtype, cudaStream_t stream) {
  if (rows == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cuda::dispatch_vec<T>(classes, {logits}, [&](auto width) {
      constexpr int VEC = decltype(width)::value;
      cross_entropy_fwd_kernel<T, VEC><<<rows, kThreads, 0, stream>>>(
          static_cast<const T*>(logits), targets, static_cast<A*>(loss), static_cast<A*>(stats),
          classes, ignore_index);
    });
  });
  cuda::check_launch("cross_entropy_fwd_kernel");
}

void launch_cross_entropy_bwd(const void* dloss, const void* logits, const int64_t* targets,
                              const void* stats, void* dlogits, int64_t rows, int64_t classes,
                              int64_t ignore_index, KernelDType dtype, cudaStream_t stream) {
  if (rows == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cuda::dispatch_vec<T>(classes, {logits, dlogits}, [&](auto width) {
      constexpr int VEC = decltype(width)::value;
      cross_entropy_bwd_kernel<T, VEC><<<rows, kThreads, 0, stream>>>(
          static_cast<const A*>(dloss), static_cast<const T*>(logits), targets,
          static_cast<const A*>(stats), static_cast<T*>(dlogits), classes, ignore_index);
    });
  });
  cuda::check_launch("cross_entropy_bwd_kernel");
}

}  // namespace fusible::kernels

// Rotary position embedding over a packed q/k/v projection: one elementwise pass each way. A
// thread takes VEC consecutive elements of one head (16 bytes when head_dim and the layouts allow,
// else one (even, odd) pair, read element by element), so a wide access is one vector load or
// store.
#include "kernels/common/cuda_common.cuh"
#include "kernels/rotary/rotary_launchers.h"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

// Pairs (x[2p], x[2p + 1]) rotated by +angle (sign 1) or -angle (sign -1, the backward).
template <typename T, int VEC>
__device__ __forceinline__ void rotate(const T (&x)[VEC], T (&y)[VEC], const acc_t<T>* cos,
                                       const acc_t<T>* sin, acc_t<T> sign) {
#pragma unroll
  for (int p = 0; p < VEC / 2; ++p) {
    const acc_t<T> c = cos[p], s = sign * sin[p];
    const acc_t<T> even = to_acc(x[2 * p]), odd = to_acc(x[2 * p + 1]);
    y[2 * p] = from_acc<T>(even * c - odd * s);
    y[2 * p + 1] = from_acc<T>(even * s + odd * c);
  }
}

template <typename T, int VEC, bool WIDE>
__global__ void qkv_rotary_fwd_kernel(const T* __restrict__ qkv, const acc_t<T>* __restrict__ cos,
                                      const acc_t<T>* __restrict__ sin, T* __restrict__ out,
                                      QkvShape shape) {
  const int64_t qk_width = 2 * shape.heads * shape.head_dim, half = shape.head_dim / 2;
  const int64_t chunks = shape.batch * shape.seq * qk_width / VEC;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i * VEC, row = o / qk_width, j = o - row * qk_width;
    const int64_t pos = row % shape.seq, pair = (j % shape.head_dim) / 2;
    T x[VEC], y[VEC];
    cuda::load_elements<WIDE>(qkv + row * (qk_width + qk_width / 2) + j, x);
    rotate<T, VEC>(x, y, cos + pos * half + pair, sin + pos * half + pair, acc_t<T>(1));
    cuda::store_elements<WIDE>(out + o, y);
  }
}

template <typename T, int VEC, bool WIDE>
__global__ void qkv_rotary_bwd_kernel(QkvGrads grads, const acc_t<T>* __restrict__ cos,
                                      const acc_t<T>* __restrict__ sin, T* __restrict__ dqkv,
                                      QkvShape shape) {
  const int64_t head_width = shape.heads * shape.head_dim, width = 3 * head_width;
  const int64_t half = shape.head_dim / 2;
  const int64_t chunks = shape.batch * shape.seq * width / VEC;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t o = i * VEC, row = o / width, j = o - row * width;
    const int which = static_cast<int>(j / head_width);
    const int64_t in_part = j - which * head_width, head = in_part / shape.head_dim;
    const int64_t e = in_part - head * shape.head_dim;
    const int64_t b = row / shape.seq, pos = row - b * shape.seq;
    const T* src = static_cast<const T*>(grads.data[which]) + b * grads.batch_stride[which] +
                   head * grads.head_stride[which] + pos * grads.seq_stride[which] + e;
    T x[VEC], y[VEC];
    cuda::load_elements<WIDE>(src, x);
    if (which == 2) {
      cuda::store_elements<WIDE>(dqkv + o, x);
    } else {
      rotate<T, VEC>(x, y, cos + pos * half + e / 2, sin + pos * half + e / 2, acc_t<T>(-1));
      cuda::store_elements<WIDE>(dqkv + o, y);
    }
  }
}

constexpr int kThreads = 256;

}  // namespace

void launch_qkv_rotary_fwd(const void* qkv, const void* cos, const void* sin, void* out,
                           const QkvShape& shape, KernelDType dtype, int num_sms,
                           cudaStream_t stream) {
  const int64_t n = shape.batch * shape.seq * 2 * shape.heads * shape.head_dim;
  if (n == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = cuda::can_vectorize(shape.head_dim, cuda::kVec16<T>, {qkv, out});
    cuda::dispatch_width<T, 2>(vec, [&](auto width) {
      constexpr int VEC = decltype(width)::value;  // one (even, odd) pair where not wide
      qkv_rotary_fwd_kernel<T, VEC, decltype(width)::wide>
          <<<cuda::grid_for(n / VEC, kThreads, num_sms), kThreads, 0, stream>>>(
              static_cast<const T*>(qkv), static_cast<const acc_t<T>*>(cos),
              static_cast<const acc_t<T>*>(sin), static_cast<T*>(out), shape);
    });
  });
  cuda::check_launch("qkv_rotary_fwd_kernel");
}

void launch_qkv_rotary_bwd(const QkvGrads& grads, const void* cos, const void* sin, void* dqkv,
                           const QkvShape& shape, KernelDType dtype, int num_sms,
                           cudaStream_t stream) {
  const int64_t n = shape.batch * shape.seq * 3 * shape.heads * shape.head_dim;
  if (n == 0) return;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    bool vec = cuda::can_vectorize(shape.head_dim, kVec,
                                   {dqkv, grads.data[0], grads.data[1], grads.data[2]});
    for (int g = 0; g < 3; ++g) {
      vec = vec && grads.batch_stride[g] % kVec == 0 && grads.head_stride[g] % kVec == 0 &&
            grads.seq_stride[g] % kVec == 0;
    }
    cuda::dispatch_width<T, 2>(vec, [&](auto width) {
      constexpr int VEC = decltype(width)::value;
      qkv_rotary_bwd_kernel<T, VEC, decltype(width)::wide>
          <<<cuda::grid_for(n / VEC, kThreads, num_sms), kThreads, 0, stream>>>(
              grads, static_cast<const acc_t<T>*>(cos), static_cast<const acc_t<T>*>(sin),
              static_cast<T*>(dqkv), shape);
    });
  });
  cuda::check_launch("qkv_rotary_bwd_kernel");
}

}  // namespace fusible::kernels

// A vectorized elementwise kernel for the raw CUDA kernels (.cu files only): out[i] = f(a[i], b[i])
// computed in the accumulation type, 16-byte loads and stores where the sizes and pointers allow.
#pragma once

#include "kernels/common/cuda_common.cuh"

namespace fusible::kernels::cuda {

// out may be a or b (an in-place update, add_(t, t)): each element is read before it is written,
// by one thread; so none of the pointers is __restrict__.
template <typename T, int VEC, typename F>
__global__ void map_kernel(const T* a, const T* b, T* out, int64_t num_vecs, F f) {
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto av = load_vec<T, VEC>(a + v * VEC);
    Vec<T, VEC> bv;
    if (b != nullptr) bv = load_vec<T, VEC>(b + v * VEC);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      o.v[j] = from_acc<T>(f(to_acc(av.v[j]), b != nullptr ? to_acc(bv.v[j]) : acc_t<T>(0)));
    }
    store_vec<T, VEC>(out + v * VEC, o);
  }
}

/// out[i] = f(a[i], b[i]) (b may be null: f gets 0) for n elements of T.
template <typename T, typename F>
void launch_map(const void* a, const void* b, void* out, int64_t n, F f, int num_sms,
                cudaStream_t stream, const char* what) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const auto* ta = static_cast<const T*>(a);
  const auto* tb = static_cast<const T*>(b);
  auto* to = static_cast<T*>(out);
  dispatch_vec<T>(n, {a, b, out}, [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    const int64_t vecs = n / V;
    map_kernel<T, V>
        <<<grid_for(vecs, kThreads, num_sms), kThreads, 0, stream>>>(ta, tb, to, vecs, f);
  });
  check_launch(what);
}

}  // namespace fusible::kernels::cuda

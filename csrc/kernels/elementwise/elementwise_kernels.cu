// Constant scale and residual add: one vectorized pass, computed in the accumulation type.
#include "kernels/common/cuda_map.cuh"
#include "kernels/elementwise/elementwise_launchers.h"

namespace fusible::kernels {
namespace {

template <typename A>
struct Scale {
  A scale;
  __device__ A operator()(A x, A) const { return scale * x; }
};
template <typename A>
struct Add {
  __device__ A operator()(A a, A b) const { return a + b; }
};

}  // namespace

void launch_scale(const void* x, void* y, int64_t n, double scale, KernelDType dtype, int num_sms,
                  cudaStream_t stream) {
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = cuda::acc_t<T>;
    cuda::launch_map<T>(x, nullptr, y, n, Scale<A>{static_cast<A>(scale)}, num_sms, stream,
                        "scale kernel");
  });
}

void launch_add(const void* a, const void* b, void* out, int64_t n, KernelDType dtype, int num_sms,
                cudaStream_t stream) {
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    cuda::launch_map<T>(a, b, out, n, Add<cuda::acc_t<T>>{}, num_sms, stream, "add kernel");
  });
}

}  // namespace fusible::kernels

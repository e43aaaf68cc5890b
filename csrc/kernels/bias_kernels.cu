// Raw CUDA kernels for bias add and the bias gradient (a deterministic two-pass column sum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda_launchers.h"

namespace fusible::kernels {
namespace {

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename T>
__device__ __forceinline__ typename Acc<T>::type to_acc(T v) {
  return static_cast<typename Acc<T>::type>(v);
}
template <>
__device__ __forceinline__ float to_acc<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_acc<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_acc(typename Acc<T>::type v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void bias_fwd_kernel(const T* __restrict__ x,     // [rows, cols]
                                const T* __restrict__ bias,  // [cols]
                                T* __restrict__ y,           // [rows, cols]
                                int64_t total, int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = from_acc<T>(to_acc(x[i]) + to_acc(bias[i % cols]));
  }
}

constexpr int kColsPerBlock = 32;
constexpr int kRowThreads = 8;

// Block (32 columns x 8 row-threads) sums one chunk of rows for 32 columns into workspace[chunk].
template <typename T>
__global__ void bias_bwd_partial_kernel(
    const T* __restrict__ dy,                     // [rows, cols]
    typename Acc<T>::type* __restrict__ partial,  // [chunks, cols]
    int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  using A = typename Acc<T>::type;
  __shared__ A tile[kRowThreads][kColsPerBlock];
  const int64_t col = blockIdx.x * static_cast<int64_t>(kColsPerBlock) + threadIdx.x;
  const int64_t row_begin = blockIdx.y * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  A sum = 0;
  if (col < cols) {
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowThreads) {
      sum += to_acc(dy[r * cols + col]);
    }
  }
  tile[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    for (int i = 1; i < kRowThreads; ++i) sum += tile[i][threadIdx.x];
    partial[blockIdx.y * cols + col] = sum;
  }
}

template <typename T>
__global__ void bias_bwd_final_kernel(
    const typename Acc<T>::type* __restrict__ partial,  // [chunks, cols]
    T* __restrict__ dbias,                              // [cols]
    int64_t cols, int64_t chunks) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= cols) return;
  typename Acc<T>::type sum = 0;
  for (int64_t c = 0; c < chunks; ++c) sum += partial[c * cols + col];
  dbias[col] = from_acc<T>(sum);
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) +
                             ": CUDA launch failed: " + cudaGetErrorString(err));
  }
}

template <typename F>
void dispatch_dtype(KernelDType dtype, F&& f) {
  switch (dtype) {
    case KernelDType::kFloat32:
      return f(float{});
    case KernelDType::kFloat64:
      return f(double{});
    case KernelDType::kFloat16:
      return f(__half{});
    case KernelDType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  throw std::runtime_error("fusible: unsupported kernel dtype");
}

}  // namespace

void launch_bias_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                     KernelDType dtype, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 32);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_fwd_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), total, cols);
  });
  check_launch("bias_fwd_kernel");
}

int64_t bias_bwd_num_chunks(int64_t rows, int64_t cols) {
  // Aim for ~4 blocks per SM of an H200 (132 SMs), each chunk at least 64 rows.
  const int64_t col_blocks = (cols + kColsPerBlock - 1) / kColsPerBlock;
  const int64_t want = std::max<int64_t>(1, (4 * 132 + col_blocks - 1) / col_blocks);
  const int64_t max_by_rows = std::max<int64_t>(1, rows / 64);
  return std::min(want, max_by_rows);
}

void launch_bias_bwd(const void* dy, void* workspace, void* dbias, int64_t rows, int64_t cols,
                     int64_t num_chunks, KernelDType dtype, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t rows_per_chunk = (rows + num_chunks - 1) / std::max<int64_t>(num_chunks, 1);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = typename Acc<T>::type;
    const dim3 grid((cols + kColsPerBlock - 1) / kColsPerBlock, num_chunks);
    const dim3 block(kColsPerBlock, kRowThreads);
    bias_bwd_partial_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(dy),
                                                           static_cast<A*>(workspace), rows, cols,
                                                           std::max<int64_t>(rows_per_chunk, 1));
    check_launch("bias_bwd_partial_kernel");
    constexpr int kThreads = 256;
    bias_bwd_final_kernel<T><<<(cols + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        static_cast<const A*>(workspace), static_cast<T*>(dbias), cols, num_chunks);
    check_launch("bias_bwd_final_kernel");
  });
}

}  // namespace fusible::kernels

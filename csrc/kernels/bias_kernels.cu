// Raw CUDA kernels for bias add and the bias gradient (a deterministic two-pass column sum).
#include <algorithm>

#include "kernels/cuda_common.cuh"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

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

// Block (32 columns x 8 row-threads) sums one chunk of rows for 32 columns into partial[chunk].
template <typename T>
__global__ void bias_bwd_partial_kernel(const T* __restrict__ dy,        // [rows, cols]
                                        acc_t<T>* __restrict__ partial,  // [chunks, cols]
                                        int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  using A = acc_t<T>;
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

}  // namespace

void launch_bias_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                     KernelDType dtype, int num_sms, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = cuda::grid_for(total, kThreads, num_sms);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    bias_fwd_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(bias), static_cast<T*>(y), total, cols);
  });
  cuda::check_launch("bias_fwd_kernel");
}

int64_t bias_bwd_num_chunks(int64_t rows, int64_t cols, int num_sms) {
  // Aim for ~4 blocks per SM, each chunk at least 64 rows.
  const int64_t col_blocks = (cols + kColsPerBlock - 1) / kColsPerBlock;
  const int64_t want = std::max<int64_t>(1, (4 * num_sms + col_blocks - 1) / col_blocks);
  const int64_t max_by_rows = std::max<int64_t>(1, rows / 64);
  return std::min(want, max_by_rows);
}

void launch_bias_bwd(const void* dy, void* workspace, void* dbias, int64_t rows, int64_t cols,
                     int64_t num_chunks, KernelDType dtype, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t rows_per_chunk = (rows + num_chunks - 1) / std::max<int64_t>(num_chunks, 1);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid((cols + kColsPerBlock - 1) / kColsPerBlock, num_chunks);
    const dim3 block(kColsPerBlock, kRowThreads);
    bias_bwd_partial_kernel<T>
        <<<grid, block, 0, stream>>>(static_cast<const T*>(dy), static_cast<acc_t<T>*>(workspace),
                                     rows, cols, std::max<int64_t>(rows_per_chunk, 1));
    cuda::check_launch("bias_bwd_partial_kernel");
    cuda::launch_column_sum<T>(workspace, dbias, cols, num_chunks, cols, stream);
  });
}

}  // namespace fusible::kernels

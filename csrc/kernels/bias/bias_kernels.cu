// Raw CUDA kernels for bias add and the bias gradient (a deterministic two-pass column sum), alone
// or after an activation's gradient (Bias + GELU/ReLU backward in one pass).
#include <algorithm>
#include <type_traits>

#include "kernels/activation/activation_math.cuh"
#include "kernels/bias/bias_launchers.h"
#include "kernels/common/cuda_common.cuh"

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

constexpr int kColThreads = 32;
constexpr int kRowThreads = 8;

// Block (32 x 8 threads, each on VEC adjacent columns) walks one chunk of rows for 32 * VEC
// columns: g = dy (or, with kAct, g = dy * act'(pre), written to dpre, which may be dy itself) and
// the chunk's column sums of g into partial[chunk], or, with one chunk, straight into dbias (no
// second pass). Fixed assignment: the sums are deterministic.
template <typename T, int VEC, bool kAct>
__global__ void bias_grad_kernel(const T* dy,                     // [rows, cols]
                                 const T* __restrict__ pre,       // [rows, cols] (kAct)
                                 T* dpre,                         // [rows, cols] (kAct)
                                 acc_t<T>* __restrict__ partial,  // [chunks, cols], or null
                                 T* __restrict__ dbias,           // [cols] when partial is null
                                 float* __restrict__ amax,  // max |dpre| (zeroed before), or null
                                 int64_t rows, int64_t cols, int64_t rows_per_chunk, ActKind act) {
  using A = acc_t<T>;
  __shared__ A tile[kRowThreads][kColThreads * VEC];
  float m = 0.f;  // max |dpre| as stored (rounded), what an FP8 cast of dpre would find
  const int64_t col = (blockIdx.x * static_cast<int64_t>(kColThreads) + threadIdx.x) * VEC;
  const int64_t row_begin = blockIdx.y * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  A sum[VEC] = {};
  if (col < cols) {
#pragma unroll 4
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowThreads) {
      const auto d = cuda::load_vec<T, VEC>(dy + r * cols + col);
      if constexpr (kAct) {
        const auto p = cuda::load_vec<T, VEC>(pre + r * cols + col);
        cuda::Vec<T, VEC> g;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const A gj = to_acc(d.v[j]) * cuda::act_derivative<A, std::is_same_v<T, __nv_bfloat16>>(
                                            act, to_acc(p.v[j]));
          g.v[j] = from_acc<T>(gj);
          sum[j] += gj;  // unrounded: dbias as accurate as the fp32 (fp64) math allows
          m = cuda::amax_with(m, static_cast<float>(to_acc(g.v[j])));
        }
        cuda::store_vec<T, VEC>(dpre + r * cols + col, g);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum[j] += to_acc(d.v[j]);
      }
    }
  }
  if (kAct && amax != nullptr) cuda::block_amax_into(m, amax);
#pragma unroll
  for (int j = 0; j < VEC; ++j) tile[threadIdx.y][threadIdx.x * VEC + j] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A total = tile[0][threadIdx.x * VEC + j];
      for (int i = 1; i < kRowThreads; ++i) total += tile[i][threadIdx.x * VEC + j];
      if (partial != nullptr) {
        partial[blockIdx.y * cols + col + j] = total;
      } else {
        dbias[col + j] = from_acc<T>(total);
      }
    }
  }
}

// Both passes of a bias gradient (with the activation's gradient when pre is given).
void bias_grad(const void* dy, const void* pre, void* dpre, void* workspace, void* dbias,
               float* amax, int64_t rows, int64_t cols, int64_t num_chunks, ActKind act,
               KernelDType dtype, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t chunks = rows > 0 ? num_chunks : 0;  // no rows: dbias is zeros
  const int64_t rows_per_chunk = chunks > 0 ? (rows + chunks - 1) / chunks : 1;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const dim3 grid((cols + kColThreads * V - 1) / (kColThreads * V), chunks);
      const dim3 block(kColThreads, kRowThreads);
      const auto* tdy = static_cast<const T*>(dy);
      // One chunk: the block's sums are the totals.
      auto* ws = chunks > 1 ? static_cast<acc_t<T>*>(workspace) : nullptr;
      auto* out = static_cast<T*>(dbias);
      if (pre != nullptr) {
        bias_grad_kernel<T, V, true>
            <<<grid, block, 0, stream>>>(tdy, static_cast<const T*>(pre), static_cast<T*>(dpre), ws,
                                         out, amax, rows, cols, rows_per_chunk, act);
      } else {
        bias_grad_kernel<T, V, false><<<grid, block, 0, stream>>>(
            tdy, nullptr, nullptr, ws, out, nullptr, rows, cols, rows_per_chunk, act);
      }
    };
    if (chunks > 0) {
      cuda::dispatch_vec<T>(cols, {dy, pre, dpre}, launch);
      cuda::check_launch("bias_grad_kernel");
    }
    if (chunks != 1) cuda::launch_column_sum<T>(workspace, dbias, cols, chunks, cols, stream);
  });
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

void launch_bias_bwd(const void* dy, void* workspace, void* dbias, int64_t rows, int64_t cols,
                     int64_t num_chunks, KernelDType dtype, cudaStream_t stream) {
  bias_grad(dy, nullptr, nullptr, workspace, dbias, nullptr, rows, cols, num_chunks, ActKind::kRelu,
            dtype, stream);
}

void launch_bias_act_bwd(const void* dy, const void* pre, void* dpre, void* workspace, void* dbias,
                         float* amax, int64_t rows, int64_t cols, int64_t num_chunks, ActKind act,
                         KernelDType dtype, cudaStream_t stream) {
  bias_grad(dy, pre, dpre, workspace, dbias, amax, rows, cols, num_chunks, act, dtype, stream);
}

}  // namespace fusible::kernels

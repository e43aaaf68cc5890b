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
// Measured with bench/kernel_variants/gelu_bias_bwd_variants.cu (GELU + bias backward of [8192,
// 16384] bf16, H100): the earlier shape (two rows loaded, then computed and stored; 4 blocks per
// SM, which spilled) 343 us; without the spill 301; the next rows' loads issued before this
// rows' math 293; with evict-first loads and stores 284, the time of a multiply moving the same
// bytes. Four rows per thread (2 blocks per SM) 330, 6 blocks per SM (spills) 318.
constexpr int kRowBatch = 2;   // rows a thread loads at once (same summation order as one by one)
constexpr int kMinBlocks = 3;  // blocks per SM the register budget must allow (no spill)
constexpr int kWaves = 2;      // waves of blocks the row chunks make (bias_grad_blocks_per_sm)

// Block (32 x 8 threads, each on VEC adjacent columns) walks one chunk of rows for 32 * VEC
// columns: g = dy (or, with kAct, g = dy * act'(pre), written to dpre, which may be dy itself) and
// the chunk's column sums of g into partial[chunk], or, with one chunk, straight into dbias (no
// second pass). Fixed assignment: the sums are deterministic. kAmax: amax is given (else the
// per-element max is not computed); kGelu: act is GELU, known at compile time (the MLP's case).
template <typename T, int VEC, bool kAct, bool kAmax = false, bool kGelu = false>
__global__ void __launch_bounds__(kColThreads* kRowThreads, kMinBlocks)
    bias_grad_kernel(const T* dy,                     // [rows, cols]
                     const T* __restrict__ pre,       // [rows, cols] (kAct)
                     T* dpre,                         // [rows, cols] (kAct)
                     acc_t<T>* __restrict__ partial,  // [chunks, cols], or null
                     T* __restrict__ dbias,           // [cols] when partial is null
                     float* __restrict__ amax,        // max |dpre| (zeroed before), or null
                     int64_t rows, int64_t cols, int64_t rows_per_chunk, ActKind act) {
  using A = acc_t<T>;
  using V = cuda::Vec<T, VEC>;
  constexpr int64_t kStep = kRowThreads * kRowBatch;
  const ActKind kind = kGelu ? ActKind::kGelu : act;  // a constant: no switch in the loop
  __shared__ A tile[kRowThreads][kColThreads * VEC];
  float m = 0.f;  // max |dpre| as stored (rounded), what an FP8 cast of dpre would find
  const int64_t col = (blockIdx.x * static_cast<int64_t>(kColThreads) + threadIdx.x) * VEC;
  const int64_t row_begin = blockIdx.y * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  A sum[VEC] = {};
  if (col < cols) {
    // A batch is kRowBatch rows, kRowThreads apart. The next batch's loads are issued before this
    // batch's math and stores: bytes in flight while the SFU works (dpre may alias dy, so the
    // compiler cannot hoist a load above a store itself; the rows differ, so the order is safe).
    V d[kRowBatch], p[kRowBatch];
    auto load = [&](int64_t r0) {
#pragma unroll
      for (int u = 0; u < kRowBatch; ++u) {
        const int64_t r = r0 + u * kRowThreads;
        if (r < row_end) {
          d[u] = cuda::load_vec_streaming<T, VEC>(dy + r * cols + col);
          if constexpr (kAct) p[u] = cuda::load_vec_streaming<T, VEC>(pre + r * cols + col);
        }
      }
    };
    int64_t r0 = row_begin + threadIdx.y;
    load(r0);
    for (; r0 < row_end; r0 += kStep) {
      V cd[kRowBatch], cp[kRowBatch];
#pragma unroll
      for (int u = 0; u < kRowBatch; ++u) {
        cd[u] = d[u];
        if constexpr (kAct) cp[u] = p[u];
      }
      if (r0 + kStep < row_end) load(r0 + kStep);
#pragma unroll
      for (int u = 0; u < kRowBatch; ++u) {
        const int64_t r = r0 + u * kRowThreads;
        if (r >= row_end) break;
        if constexpr (kAct) {
          V g;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const A gj =
                to_acc(cd[u].v[j]) *
                cuda::act_derivative<A, std::is_same_v<T, __nv_bfloat16>>(kind, to_acc(cp[u].v[j]));
            g.v[j] = from_acc<T>(gj);
            sum[j] += gj;  // unrounded: dbias as accurate as the fp32 (fp64) math allows
            if constexpr (kAmax) m = cuda::amax_with(m, static_cast<float>(to_acc(g.v[j])));
          }
          cuda::store_vec_streaming<T, VEC>(dpre + r * cols + col, g);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) sum[j] += to_acc(cd[u].v[j]);
        }
      }
    }
  }
  if constexpr (kAmax) cuda::block_amax_into(m, amax);
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
        auto act_kernel = [&](auto with_amax, auto gelu) {
          bias_grad_kernel<T, V, true, decltype(with_amax)::value, decltype(gelu)::value>
              <<<grid, block, 0, stream>>>(tdy, static_cast<const T*>(pre), static_cast<T*>(dpre),
                                           ws, out, amax, rows, cols, rows_per_chunk, act);
        };
        auto with_gelu = [&](auto with_amax) {
          // GELU fixed at compile time only where it is worth a kernel: 16-bit data, wide access.
          if constexpr (sizeof(T) == 2 && decltype(vec)::wide) {
            if (act == ActKind::kGelu) return act_kernel(with_amax, std::true_type{});
          }
          act_kernel(with_amax, std::false_type{});
        };
        if (amax != nullptr) {
          with_gelu(std::true_type{});
        } else {
          with_gelu(std::false_type{});
        }
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

int bias_grad_blocks_per_sm(bool act, KernelDType dtype) {
  int blocks = 0;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = cuda::kVec16<T>;
    constexpr int threads = kColThreads * kRowThreads;
    blocks = act ? cuda::resident_blocks_here(bias_grad_kernel<T, V, true>, threads)
                 : cuda::resident_blocks_here(bias_grad_kernel<T, V, false>, threads);
  });
  return blocks * kWaves;
}

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

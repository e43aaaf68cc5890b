// Raw CUDA kernels of the grouped GEMM path (GroupedLinear): the device-side split check and group
// table, a SIMT grouped GEMM (fallback where torch._grouped_mm's CUTLASS kernels do not apply),
// the bias / scale gradients. All read the split from the table.
#include <cassert>
#include <cstdio>

#include "kernels/common/cuda_common.cuh"
#include "kernels/grouped/grouped_launchers.h"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

// Index of the first of n non-decreasing values greater than v.
__device__ __forceinline__ int upper_bound(const int32_t* values, int n, int64_t v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (values[mid] <= v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One thread: the split is tiny (one entry per group) and must be checked before any use.
template <typename I>
__global__ void group_table_kernel(const I* __restrict__ sizes, int groups, int64_t rows,
                                   int32_t* __restrict__ table) {
  int64_t total = 0;
  int32_t tiles = 0;
  for (int g = 0; g < groups; ++g) {
    const int64_t s = static_cast<int64_t>(sizes[g]);
    if (s < 0) {
      printf("fusible GroupedLinear: split size %lld of group %d is negative\n",
             static_cast<long long>(s), g);
      __assert_fail("fusible GroupedLinear: expected non-negative split sizes", __FILE__, __LINE__,
                    __func__);
    }
    total += s;
    table[g] = static_cast<int32_t>(total < rows ? total : rows);
    table[groups + g] = tiles;
    tiles += static_cast<int32_t>((s + kGroupTileRows - 1) / kGroupTileRows);
  }
  table[2 * groups] = tiles;
  if (total != rows) {
    printf("fusible GroupedLinear: split sizes sum to %lld, the input has %lld rows\n",
           static_cast<long long>(total), static_cast<long long>(rows));
    __assert_fail("fusible GroupedLinear: expected split sizes summing to the input's rows",
                  __FILE__, __LINE__, __func__);
  }
}

constexpr int kBM = 64, kBN = 64, kBK = 16, kGemmThreads = 256;

// One kBM x kBN tile of C = A B (+ bias[n], times scales[m] when given) over k in [k_begin,
// k_end): A (m, k) at a[m * sam + k * sak], B (k, n) at b[k * sbk + n * sbn], C (m, n) at
// c[m * scm + n * scn]; rows m < m_end, columns n < n_end. The bias joins the accumulator before
// the one rounding. 256 threads, 4 x 4 outputs each (rows ty + 16 i, columns tx + 16 j).
template <typename T>
__device__ void gemm_tile(const T* __restrict__ a, int64_t sam, int64_t sak,
                          const T* __restrict__ b, int64_t sbk, int64_t sbn, int64_t m0,
                          int64_t m_end, int64_t n0, int64_t n_end, int64_t k_begin, int64_t k_end,
                          T* __restrict__ c, int64_t scm, int64_t scn, const T* __restrict__ bias,
                          const T* __restrict__ scales) {
  using A = acc_t<T>;
  __shared__ A as[kBK][kBM + 1];
  __shared__ A bs[kBK][kBN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  A acc[4][4] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kBK) {
    for (int i = threadIdx.x; i < kBM * kBK; i += kGemmThreads) {
      // The unit-stride index varies fastest across threads: coalesced loads.
      const int mm = sak == 1 ? i / kBK : i % kBM, kk = sak == 1 ? i % kBK : i / kBM;
      const int64_t m = m0 + mm, k = k0 + kk;
      as[kk][mm] = m < m_end && k < k_end ? to_acc(a[m * sam + k * sak]) : A(0);
    }
    for (int i = threadIdx.x; i < kBK * kBN; i += kGemmThreads) {
      const int nn = sbn == 1 ? i % kBN : i / kBK, kk = sbn == 1 ? i / kBN : i % kBK;
      const int64_t n = n0 + nn, k = k0 + kk;
      bs[kk][nn] = n < n_end && k < k_end ? to_acc(b[k * sbk + n * sbn]) : A(0);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      A av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = bs[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty + 16 * i;
    if (m >= m_end) continue;
    const A s = scales ? to_acc(scales[m]) : A(1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (n >= n_end) continue;
      c[m * scm + n * scn] = from_acc<T>(bias ? acc[i][j] + to_acc(bias[n]) * s : acc[i][j]);
    }
  }
}

// The group of row tile `tile` and the tile's first row; false past the last tile.
__device__ __forceinline__ bool tile_group(const int32_t* table, int groups, int64_t tile, int& g,
                                           int64_t& first_row, int64_t& group_end) {
  const int32_t* tile_starts = table + groups;
  if (tile >= tile_starts[groups]) return false;
  g = upper_bound(tile_starts, groups + 1, tile) - 1;
  const int64_t start = g == 0 ? 0 : table[g - 1];
  first_row = start + (tile - tile_starts[g]) * kGroupTileRows;
  group_end = table[g];
  return true;
}

template <typename T>
__global__ void grouped_rows_gemm_kernel(const T* a, int64_t sam, int64_t sak, const T* b,
                                         int64_t sbg, int64_t sbk, int64_t sbn, T* c, int64_t n,
                                         int64_t k, const T* bias, const T* scales,
                                         const int32_t* table, int groups) {
  int g;
  int64_t m0, m_end;
  if (!tile_group(table, groups, blockIdx.x, g, m0, m_end)) return;
  gemm_tile(a, sam, sak, b + g * sbg, sbk, sbn, m0, m_end, blockIdx.y * int64_t{kBN}, n, 0, k, c, n,
            1, bias ? bias + g * n : nullptr, scales);
}

template <typename T>
__global__ void grouped_wgrad_gemm_kernel(const T* dy, const T* x, T* dw, int64_t n, int64_t k,
                                          const int32_t* table, int groups) {
  const int g = blockIdx.z;
  const int64_t start = g == 0 ? 0 : table[g - 1], end = table[g];
  // dw_g (n, k) = sum over rows r of dy[r, n] x[r, k]: A = dy^T, B = x, the rows contracted.
  gemm_tile(dy, 1, n, x, k, 1, blockIdx.x * int64_t{kBM}, n, blockIdx.y * int64_t{kBN}, k, start,
            end, dw + g * n * k, k, 1, static_cast<const T*>(nullptr),
            static_cast<const T*>(nullptr));
}

template <typename T>
__global__ void zero_empty_groups_kernel(T* dw, const int32_t* table, int64_t per_group) {
  const int g = blockIdx.y;
  const int64_t start = g == 0 ? 0 : table[g - 1];
  if (table[g] != start) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per_group;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dw[g * per_group + i] = from_acc<T>(acc_t<T>(0));
  }
}

// Pass 1: partial[tile, col] = sum over the tile's rows of dy[r, col] (times scales[r]).
template <typename T>
__global__ void grouped_bias_partial_kernel(const T* __restrict__ dy,
                                            const acc_t<T>* __restrict__ scales,
                                            const int32_t* table, int groups, int64_t cols,
                                            acc_t<T>* __restrict__ partial) {
  int g;
  int64_t first, group_end;
  if (!tile_group(table, groups, blockIdx.x, g, first, group_end)) return;
  const int64_t col = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= cols) return;
  const int64_t last = min(group_end, first + kGroupTileRows);
  acc_t<T> sum = 0;
  for (int64_t r = first; r < last; ++r) {
    const acc_t<T> d = to_acc(dy[r * cols + col]);
    sum += scales ? d * scales[r] : d;
  }
  partial[blockIdx.x * cols + col] = sum;
}

// Pass 2: dbias[g, col] = the sum of group g's tiles, in tile order (deterministic).
template <typename T>
__global__ void grouped_bias_total_kernel(const acc_t<T>* __restrict__ partial,
                                          const int32_t* table, int groups, int64_t cols,
                                          T* __restrict__ dbias) {
  const int g = blockIdx.y;
  const int64_t col = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (col >= cols) return;
  const int32_t* tile_starts = table + groups;
  acc_t<T> sum = 0;
  for (int32_t t = tile_starts[g]; t < tile_starts[g + 1]; ++t) sum += partial[t * cols + col];
  dbias[g * cols + col] = from_acc<T>(sum);
}

// One warp per row.
template <typename T>
__global__ void grouped_scale_grad_kernel(const T* __restrict__ dy, const T* __restrict__ bias,
                                          const int32_t* table, int groups, int64_t rows,
                                          int64_t cols, acc_t<T>* __restrict__ dscales) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows;
       r += warps) {
    const int g = upper_bound(table, groups, r);
    acc_t<T> sum = 0;
    for (int64_t col = lane; col < cols; col += 32) {
      sum += to_acc(dy[r * cols + col]) * to_acc(bias[g * cols + col]);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) dscales[r] = sum;
  }
}

}  // namespace

void launch_group_table(const void* sizes, bool sizes_int64, int64_t groups, int64_t rows,
                        int32_t* table, cudaStream_t stream) {
  if (sizes_int64) {
    group_table_kernel<<<1, 1, 0, stream>>>(static_cast<const int64_t*>(sizes),
                                            static_cast<int>(groups), rows, table);
  } else {
    group_table_kernel<<<1, 1, 0, stream>>>(static_cast<const int32_t*>(sizes),
                                            static_cast<int>(groups), rows, table);
  }
  cuda::check_launch("group_table_kernel");
}

void launch_grouped_rows_gemm(const void* a, int64_t sam, int64_t sak, const void* b, int64_t sbg,
                              int64_t sbk, int64_t sbn, void* c, int64_t rows, int64_t n, int64_t k,
                              const void* bias, const void* scales, const int32_t* table,
                              int64_t groups, KernelDType dtype, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  const dim3 grid(static_cast<unsigned>(group_max_tiles(rows, groups)),
                  static_cast<unsigned>((n + kBN - 1) / kBN));
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    grouped_rows_gemm_kernel<T><<<grid, kGemmThreads, 0, stream>>>(
        static_cast<const T*>(a), sam, sak, static_cast<const T*>(b), sbg, sbk, sbn,
        static_cast<T*>(c), n, k, static_cast<const T*>(bias), static_cast<const T*>(scales), table,
        static_cast<int>(groups));
  });
  cuda::check_launch("grouped_rows_gemm_kernel");
}

void launch_grouped_wgrad_gemm(const void* dy, const void* x, void* dw, int64_t rows, int64_t n,
                               int64_t k, const int32_t* table, int64_t groups, KernelDType dtype,
                               cudaStream_t stream) {
  (void)rows;
  if (n == 0 || k == 0) return;
  const dim3 grid(static_cast<unsigned>((n + kBM - 1) / kBM),
                  static_cast<unsigned>((k + kBN - 1) / kBN), static_cast<unsigned>(groups));
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    grouped_wgrad_gemm_kernel<T><<<grid, kGemmThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dw), n, k, table,
        static_cast<int>(groups));
  });
  cuda::check_launch("grouped_wgrad_gemm_kernel");
}

void launch_zero_empty_groups(void* dw, const int32_t* table, int64_t groups, int64_t per_group,
                              KernelDType dtype, cudaStream_t stream) {
  if (per_group == 0) return;
  constexpr int kThreads = 256;
  // Few blocks per group: most groups are not empty and their blocks only read the table.
  const int64_t blocks = std::min<int64_t>((per_group + kThreads - 1) / kThreads, 64);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(groups));
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    zero_empty_groups_kernel<T>
        <<<grid, kThreads, 0, stream>>>(static_cast<T*>(dw), table, per_group);
  });
  cuda::check_launch("zero_empty_groups_kernel");
}

void launch_grouped_bias_grad(const void* dy, const void* scales, const int32_t* table,
                              int64_t groups, int64_t rows, int64_t cols, void* partial,
                              void* dbias, KernelDType dtype, cudaStream_t stream) {
  if (cols == 0) return;
  constexpr int kThreads = 256;
  const auto col_blocks = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    auto* part = static_cast<acc_t<T>*>(partial);
    if (rows > 0) {
      const dim3 grid(static_cast<unsigned>(group_max_tiles(rows, groups)), col_blocks);
      grouped_bias_partial_kernel<T><<<grid, kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const acc_t<T>*>(scales), table,
          static_cast<int>(groups), cols, part);
      cuda::check_launch("grouped_bias_partial_kernel");
    }
    const dim3 grid(col_blocks, static_cast<unsigned>(groups));
    grouped_bias_total_kernel<T><<<grid, kThreads, 0, stream>>>(
        part, table, static_cast<int>(groups), cols, static_cast<T*>(dbias));
  });
  cuda::check_launch("grouped_bias_total_kernel");
}

void launch_grouped_scale_grad(const void* dy, const void* bias, const int32_t* table,
                               int64_t groups, int64_t rows, int64_t cols, void* dscales,
                               KernelDType dtype, int num_sms, cudaStream_t stream) {
  if (rows == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows + 7) / 8, static_cast<int64_t>(num_sms) * 8);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    grouped_scale_grad_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(bias), table, static_cast<int>(groups),
        rows, cols, static_cast<acc_t<T>*>(dscales));
  });
  cuda::check_launch("grouped_scale_grad_kernel");
}

}  // namespace fusible::kernels

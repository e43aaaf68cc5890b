// Block-scaled FP8 casts (Float8BlockScaling) in one pass per 128x128 tile: the tile goes through
// shared memory once; each 1x128 row block, 128x1 column block (the transpose's 1x128 blocks) or
// the whole tile gets its amax and a power-of-two scale; then the FP8 rows and the FP8 transpose
// are written with their scale_inv in the layout cuBLASLt's block-scaled GEMMs read.
#include <cuda_fp8.h>

#include <cfloat>

#include "kernels/common/cuda_common.cuh"
#include "kernels/fp8/fp8_launchers.h"
#include "kernels/fp8/fp8_math.cuh"

namespace fusible::kernels {
namespace {

using cuda::amax_with;
using cuda::fp8_bits;
using cuda::fp8_max_of;

constexpr int kTile = 128, kThreads = 256, kVec = 8;  // 8 x 16-bit: 16-byte loads
constexpr int kPitch = kTile + kVec;                  // shared row pitch, 16-byte aligned rows

// fmax / amax rounded down to a power of two (frexp: exact), 1 where amax is 0 or not finite,
// at most 2^127 (as the ATen reference).
__device__ __forceinline__ float pow2_scale(float amax, float fmax) {
  if (!(isfinite(amax) && amax > 0.f)) return 1.f;
  const float s = fminf(fmax / amax, FLT_MAX);
  int e = 0;
  frexpf(s, &e);  // s = m * 2^e, m in [0.5, 1)
  return ldexpf(1.f, e - 1);
}

// scale_inv layouts (kernels/fp8/fp8_block.h): 1x128 blocks of [rows, cols]: [cols / 128,
// round_up(rows, 4)], entry [kb, r]; 128x128: [rows / 128, round_up(cols / 128, 4)], entry
// [rb, kb].
__host__ __device__ __forceinline__ int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }

template <typename T>
__global__ void cast_block_kernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                  float* __restrict__ scale_inv, uint8_t* __restrict__ data_t,
                                  float* __restrict__ scale_inv_t, int64_t rows, int64_t cols,
                                  bool two_d, bool e4m3) {
  __shared__ alignas(16) T tile[kTile * kPitch];
  __shared__ float row_scale[kTile], col_scale[kTile], warp_max[kThreads / 32];
  __shared__ float col_part[kThreads / 32][kTile];  // per warp: its rows' column maxima
  const int64_t col_tiles = cols / kTile;
  const int64_t rb = blockIdx.x / col_tiles, cb = blockIdx.x % col_tiles;
  const int64_t r0 = rb * kTile, c0 = cb * kTile;
  const float fmax = fp8_max_of(e4m3);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  constexpr int kVecsPerRow = kTile / kVec;  // 16: a row is held by 16 consecutive threads

  // Load: thread t holds columns (t % 16) * 8.. of rows t / 16 + 16 i. The amaxes in registers
  // on the way: each row's by shuffles over its 16 threads, each column's per thread, then over
  // the two half-warps and, in shared memory, over the warps.
  float m = 0.f, cmax[kVec] = {};
  const int cl = t % kVecsPerRow * kVec;  // this thread's first column
#pragma unroll
  for (int i = 0; i < kTile * kTile / kVec / kThreads; ++i) {
    const int r = t / kVecsPerRow + kThreads / kVecsPerRow * i;
    const auto xv = cuda::load_vec<T, kVec>(x + (r0 + r) * cols + c0 + cl);
    *reinterpret_cast<cuda::Vec<T, kVec>*>(&tile[r * kPitch + cl]) = xv;
    float rm = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = static_cast<float>(cuda::to_acc(xv.v[j]));
      rm = amax_with(rm, f);
      cmax[j] = amax_with(cmax[j], f);
    }
    m = fmaxf(m, rm);
    if (!two_d) {
      for (int o = kVecsPerRow / 2; o > 0; o /= 2) {
        rm = fmaxf(rm, __shfl_xor_sync(0xffffffffu, rm, o));
      }
      if (t % kVecsPerRow == 0) row_scale[r] = rm;  // the row's amax, for now
    }
  }
  if (two_d) {
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) warp_max[warp] = m;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], kVecsPerRow));
      if (lane < kVecsPerRow) col_part[warp][cl + j] = cmax[j];
    }
  }
  __syncthreads();
  if (two_d) {
    if (t == 0) {
      float a = warp_max[0];
      for (int w = 1; w < kThreads / 32; ++w) a = fmaxf(a, warp_max[w]);
      const float s = pow2_scale(a, fmax);
      row_scale[0] = s;
      if (scale_inv) scale_inv[rb * round4(col_tiles) + cb] = 1.f / s;
      if (scale_inv_t) scale_inv_t[cb * round4(rows / kTile) + rb] = 1.f / s;
    }
  } else if (t < kTile) {  // thread t: row t's and column t's scales
    float mc = col_part[0][t];
    for (int w = 1; w < kThreads / 32; ++w) mc = fmaxf(mc, col_part[w][t]);
    const float sr = pow2_scale(row_scale[t], fmax), sc = pow2_scale(mc, fmax);
    row_scale[t] = sr;
    col_scale[t] = sc;
    if (scale_inv) scale_inv[cb * round4(rows) + r0 + t] = 1.f / sr;
    if (scale_inv_t) scale_inv_t[rb * round4(cols) + c0 + t] = 1.f / sc;
  }
  __syncthreads();

  if (data != nullptr) {  // rows: 8-byte stores
#pragma unroll
    for (int i = 0; i < kTile * kTile / kVec / kThreads; ++i) {
      const int v = t + kThreads * i, r = v / (kTile / kVec), c = v % (kTile / kVec) * kVec;
      const float s = two_d ? row_scale[0] : row_scale[r];
      const auto xv = *reinterpret_cast<const cuda::Vec<T, kVec>*>(&tile[r * kPitch + c]);
      cuda::Vec<uint8_t, kVec> q;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        q.v[j] = fp8_bits(static_cast<float>(cuda::to_acc(xv.v[j])) * s, fmax, e4m3);
      }
      cuda::store_vec<uint8_t, kVec>(data + (r0 + r) * cols + c0 + c, q);
    }
  }
  if (data_t != nullptr) {  // the transpose: each thread 8 rows of one column, 8-byte stores
#pragma unroll
    for (int i = 0; i < kTile * kTile / kVec / kThreads; ++i) {
      const int v = t + kThreads * i, c = v % kTile, r = v / kTile * kVec;
      const float s = two_d ? row_scale[0] : col_scale[c];
      cuda::Vec<uint8_t, kVec> q;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        q.v[j] =
            fp8_bits(static_cast<float>(cuda::to_acc(tile[(r + j) * kPitch + c])) * s, fmax, e4m3);
      }
      cuda::store_vec<uint8_t, kVec>(data_t + (c0 + c) * rows + r0 + r, q);
    }
  }
}

}  // namespace

void launch_fp8_cast_block(const void* x, void* data, float* scale_inv, void* data_t,
                           float* scale_inv_t, int64_t rows, int64_t cols, int64_t block_dim,
                           bool e4m3, KernelDType dtype, cudaStream_t stream) {
  const int64_t blocks = rows / kTile * (cols / kTile);
  if (blocks == 0) return;
  const auto launch = [&](auto tag) {
    using T = decltype(tag);
    cast_block_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<uint8_t*>(data), scale_inv,
        static_cast<uint8_t*>(data_t), scale_inv_t, rows, cols, block_dim == 2, e4m3);
  };
  if (dtype == KernelDType::kBFloat16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
  cuda::check_launch("cast_block_kernel");
}

}  // namespace fusible::kernels

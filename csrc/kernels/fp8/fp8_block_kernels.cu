// Block-scaled FP8 casts (Float8BlockScaling) in one pass per 128x128 tile: the tile goes through
// shared memory once; each 1x128 row block, 128x1 column block (the transpose's 1x128 blocks) or
// the whole tile gets its amax and a power-of-two scale; then the FP8 rows and the FP8 transpose
// are written with their scale_inv in the layout cuBLASLt's block-scaled GEMMs read.
#include <cuda_fp8.h>

#include <cfloat>

#include "kernels/activation/activation_math.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/fp8/fp8_launchers.h"
#include "kernels/fp8/fp8_math.cuh"

namespace fusible::kernels {
namespace {

using cuda::amax_with;
using cuda::fp8_max_of;
using cuda::fp8_pack;

constexpr int kTile = 128, kThreads = 256, kVec = 8;  // 8 x 16-bit: 16-byte loads
constexpr int kVecsPerRow = kTile / kVec;             // 16

// The shared tile holds 128 rows of 16 vectors with no padding; vector vi of row r sits in slot
// vi ^ ((r / 8) % 8) of its row. The transpose reads two columns of 8 consecutive rows per thread,
// 16 row groups per warp: unswizzled, every group would hit the same banks (a 16-way conflict);
// swizzled, a warp's 32 word reads fall on 16 banks. Whole vectors move, so 16-byte accesses stay
// aligned.
__device__ __forceinline__ int tile_slot(int r, int vi) {
  return r * kVecsPerRow + (vi ^ ((r >> 3) & 7));
}

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

// With kAct, the tile holds act(x) rounded to T: the cast of an activation's output from its input.
template <typename T, bool kAct = false>
__global__ void cast_block_kernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                  float* __restrict__ scale_inv, uint8_t* __restrict__ data_t,
                                  float* __restrict__ scale_inv_t, int64_t rows, int64_t cols,
                                  bool two_d, bool e4m3, ActKind act) {
  using V = cuda::Vec<T, kVec>;
  __shared__ V tile[kTile * kVecsPerRow];
  __shared__ float row_scale[kTile], col_scale[kTile], warp_max[kThreads / 32];
  __shared__ float col_part[kThreads / 32][kTile];  // per warp: its rows' column maxima
  const int64_t col_tiles = (cols + kTile - 1) / kTile, row_tiles = (rows + kTile - 1) / kTile;
  const int64_t rb = blockIdx.x / col_tiles, cb = blockIdx.x % col_tiles;
  const int64_t r0 = rb * kTile, c0 = cb * kTile;
  const float fmax = fp8_max_of(e4m3);
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  constexpr int kPasses = kTile * kTile / kVec / kThreads;  // 8

  // Load: thread t holds vector t % 16 (columns (t % 16) * 8..) of rows t / 16 + 16 i; a tile
  // past the matrix's last row or column is zero there (no effect on any amax). The amaxes in
  // registers on the way: each row's by shuffles over its 16 threads, each column's per thread,
  // then over the two half-warps and, in shared memory, over the warps.
  float m = 0.f, cmax[kVec] = {};
  const int vi = t % kVecsPerRow, cl = vi * kVec;
  const bool col_in = c0 + cl < cols;  // cols is a multiple of 8: a vector is all in or all out
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int r = t / kVecsPerRow + kThreads / kVecsPerRow * i;
    V xv;
    if (col_in && r0 + r < rows) {
      xv = cuda::load_vec<T, kVec>(x + (r0 + r) * cols + c0 + cl);
      if constexpr (kAct) {  // in range only: outside, the zeros stay zeros
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          // The fast forms for 16-bit data, as activation_fwd's (the same bytes).
          xv.v[j] =
              cuda::from_acc<T>(cuda::act_value<cuda::acc_t<T>, true>(act, cuda::to_acc(xv.v[j])));
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) xv.v[j] = cuda::from_acc<T>(0.f);
    }
    tile[tile_slot(r, vi)] = xv;
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
      if (vi == 0) row_scale[r] = rm;  // the row's amax, for now
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
      if (scale_inv_t) scale_inv_t[cb * round4(row_tiles) + rb] = 1.f / s;
      // The layouts' padding (up to 3 entries per row of scales) is zero: the last tile of a row
      // (column) of tiles writes it, so the scales need no zeroed allocation.
      for (int64_t p = col_tiles; scale_inv && cb == col_tiles - 1 && p < round4(col_tiles); ++p) {
        scale_inv[rb * round4(col_tiles) + p] = 0.f;
      }
      for (int64_t p = row_tiles; scale_inv_t && rb == row_tiles - 1 && p < round4(row_tiles);
           ++p) {
        scale_inv_t[cb * round4(row_tiles) + p] = 0.f;
      }
    }
  } else if (t < kTile) {  // thread t: row t's and column t's scales
    float mc = col_part[0][t];
    for (int w = 1; w < kThreads / 32; ++w) mc = fmaxf(mc, col_part[w][t]);
    const float sr = pow2_scale(row_scale[t], fmax), sc = pow2_scale(mc, fmax);
    row_scale[t] = sr;
    col_scale[t] = sc;
    // Rows (columns) past the end up to the next multiple of 4 are the layout's padding, zero;
    // they fall in the last tile (tiles start at multiples of 128).
    if (scale_inv && r0 + t < round4(rows)) {
      scale_inv[cb * round4(rows) + r0 + t] = r0 + t < rows ? 1.f / sr : 0.f;
    }
    if (scale_inv_t && c0 + t < round4(cols)) {
      scale_inv_t[rb * round4(cols) + c0 + t] = c0 + t < cols ? 1.f / sc : 0.f;
    }
  }
  __syncthreads();

  if (data != nullptr) {  // rows: 16 threads per 128-byte row, 8-byte stores
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int r = t / kVecsPerRow + kThreads / kVecsPerRow * i;
      if (!col_in || r0 + r >= rows) continue;
      const float s = two_d ? row_scale[0] : row_scale[r];
      const V xv = tile[tile_slot(r, vi)];
      float f[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) f[j] = static_cast<float>(cuda::to_acc(xv.v[j])) * s;
      cuda::Vec<uint8_t, kVec> q;
      fp8_pack(f, q.v, e4m3);
      cuda::store_vec<uint8_t, kVec>(data + (r0 + r) * cols + c0 + cl, q);
    }
  }
  if (data_t != nullptr) {
    // The transpose: a task is columns 2p and 2p + 1 over rows 8g..8g + 7 (p < 64, g < 16), read
    // as 8 two-element words; a warp's 32 tasks are 16 row groups of two pairs, so each of its
    // stores writes whole 128-byte rows of data_t.
#pragma unroll
    for (int i = 0; i < kPasses / 2; ++i) {
      const int task = t + kThreads * i, g = task % 16, p = task / 16;
      const int c = 2 * p, pvi = c / kVec, pj = c % kVec;
      // rows is a multiple of 8 with a transpose: a row group is all in or all out.
      if (c0 + c >= cols || r0 + 8 * g >= rows) continue;
      const float s0 = two_d ? row_scale[0] : col_scale[c];
      const float s1 = two_d ? row_scale[0] : col_scale[c + 1];
      float f0[kVec], f1[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const T* e = tile[tile_slot(8 * g + j, pvi)].v + pj;
        f0[j] = static_cast<float>(cuda::to_acc(e[0])) * s0;
        f1[j] = static_cast<float>(cuda::to_acc(e[1])) * s1;
      }
      cuda::Vec<uint8_t, kVec> q0, q1;
      fp8_pack(f0, q0.v, e4m3);
      fp8_pack(f1, q1.v, e4m3);
      cuda::store_vec<uint8_t, kVec>(data_t + (c0 + c) * rows + r0 + 8 * g, q0);
      cuda::store_vec<uint8_t, kVec>(data_t + (c0 + c + 1) * rows + r0 + 8 * g, q1);
    }
  }
}

}  // namespace

void launch_fp8_cast_block(const void* x, void* data, float* scale_inv, void* data_t,
                           float* scale_inv_t, int64_t rows, int64_t cols, int64_t block_dim,
                           bool e4m3, KernelDType dtype, cudaStream_t stream, const ActKind* act) {
  const int64_t blocks = (rows + kTile - 1) / kTile * ((cols + kTile - 1) / kTile);
  if (blocks == 0) return;
  const auto launch = [&](auto tag) {
    using T = decltype(tag);
    const auto kernel = act != nullptr ? cast_block_kernel<T, true> : cast_block_kernel<T, false>;
    kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<uint8_t*>(data),
                                            scale_inv, static_cast<uint8_t*>(data_t), scale_inv_t,
                                            rows, cols, block_dim == 2, e4m3,
                                            act != nullptr ? *act : ActKind::kGelu);
  };
  if (dtype == KernelDType::kBFloat16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
  cuda::check_launch("cast_block_kernel");
}

}  // namespace fusible::kernels

// FP8 casts: the tensor's amax in one pass (a block max, then an atomic max on the float's bits,
// which order as ints for non-negative floats), then one pass that computes the scale on the
// device and casts: to FP8 and back (the numerics of FP8 GEMM operands), or to FP8 data and its
// transpose (the operands themselves). Delayed scaling casts with its held scale, takes the amax
// in the same pass, then rolls its amax history and sets the next scale in one small kernel. No
// host synchronization anywhere.
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cfloat>
#include <set>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "kernels/activation/activation_math.cuh"
#include "kernels/common/cuda_common.cuh"
#include "kernels/fp8/fp8_launchers.h"
#include "kernels/fp8/fp8_math.cuh"

namespace fusible::kernels {
namespace {

using cuda::amax_with;
using cuda::block_amax_into;
using cuda::fp8_max_of;
using cuda::fp8_pack;

constexpr int kThreads = 256;

// One element as a cast reads it: with kAct, act(x) rounded to T, the bytes activation_fwd would
// have written (an activation deferred to the cast of its output: no tensor of it is written);
// else x.
template <typename T, bool kAct>
__device__ __forceinline__ float cast_input(T v, ActKind act) {
  if constexpr (kAct) {
    using A = cuda::acc_t<T>;
    return static_cast<float>(
        cuda::to_acc(cuda::from_acc<T>(cuda::act_value<A, sizeof(T) == 2>(act, cuda::to_acc(v)))));
  } else {
    return static_cast<float>(cuda::to_acc(v));
  }
}

// This thread's amax of vectors v, v + stride, ... below end (VEC elements each; 16-byte loads
// where VEC > 1), kUnroll independent loads in flight: one per thread leaves Hopper's memory system
// short of requests.
template <typename T, int VEC, bool kAct = false>
__device__ __forceinline__ float amax_of_vectors(const T* __restrict__ x, int64_t v, int64_t end,
                                                 int64_t stride, ActKind act = ActKind::kGelu) {
  constexpr int kUnroll = 4;
  float m = 0.f;
  for (; v + (kUnroll - 1) * stride < end; v += kUnroll * stride) {
    cuda::Vec<T, VEC> xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) xv[u] = cuda::load_vec<T, VEC>(x + (v + u * stride) * VEC);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) m = amax_with(m, cast_input<T, kAct>(xv[u].v[j], act));
    }
  }
  for (; v < end; v += stride) {
    const auto xv = cuda::load_vec<T, VEC>(x + v * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) m = amax_with(m, cast_input<T, kAct>(xv.v[j], act));
  }
  return m;
}

// amax over num_vecs vectors of VEC elements (of act(x) with kAct), grid-strided.
template <typename T, int VEC, bool kAct = false>
__global__ void amax_kernel(const T* __restrict__ x, int64_t num_vecs, float* __restrict__ amax,
                            ActKind act) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  block_amax_into(amax_of_vectors<T, VEC, kAct>(x, v, num_vecs, stride, act), amax);
}

// The activation on load only for 16-bit data (the casts of a deferred activation's output).
template <typename T>
constexpr bool kActLoads = sizeof(T) == 2;

template <typename T>
void launch_amax(const T* x, int64_t n, float* amax, int num_sms, cudaStream_t stream,
                 const ActKind* act) {
  cuda::dispatch_vec<T>(n, {x}, [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    const int64_t vecs = n / V;
    const int64_t blocks = cuda::grid_for(vecs, kThreads, num_sms);
    if constexpr (kActLoads<T>) {
      if (act != nullptr) {
        amax_kernel<T, V, true><<<blocks, kThreads, 0, stream>>>(x, vecs, amax, *act);
        return;
      }
    }
    amax_kernel<T, V><<<blocks, kThreads, 0, stream>>>(x, vecs, amax, ActKind::kGelu);
  });
  cuda::check_launch("amax_kernel");
}

// fmax / amax * 2^-margin, or `fallback` where amax is 0 or not finite; the largest float where
// the division overflows (an infinite scale would turn zeros into NaN), as the ATen version.
__device__ __forceinline__ float scale_from(float amax, float fmax, float margin_factor,
                                            float fallback) {
  return isfinite(amax) && amax > 0.f ? fminf(fmax / amax * margin_factor, FLT_MAX) : fallback;
}

__device__ __forceinline__ float fp8_round(float v, bool e4m3) {
  const auto q = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, e4m3 ? __NV_E4M3 : __NV_E5M2)));
}

// y = fp8(clamp(x * s)) / s with s from amax (current scaling) or held in *scale (delayed).
template <typename T, int VEC>
__global__ void qdq_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t num_vecs,
                           const float* __restrict__ amax, const float* __restrict__ scale,
                           float fmax, float margin_factor, bool e4m3) {
  using A = cuda::acc_t<T>;
  const float s = scale != nullptr ? *scale : scale_from(*amax, fmax, margin_factor, 1.f);
  const A inv = A(1) / A(s);
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const auto xv = cuda::load_vec<T, VEC>(x + v * VEC);
    cuda::Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float v = static_cast<float>(cuda::to_acc(xv.v[j]) * A(s));
      const float scaled = isnan(v) ? v : fminf(fmaxf(v, -fmax), fmax);  // NaN stays NaN
      o.v[j] = cuda::from_acc<T>(A(fp8_round(scaled, e4m3)) * inv);
    }
    cuda::store_vec<T, VEC>(y + v * VEC, o);
  }
}

// cast_transpose_kernel's tile: 128 rows x 64 columns, 256 threads. 128 rows make each row of the
// transpose one 128-byte line; the shared tile's 65-byte pitch keeps the column reads free of bank
// conflicts.
constexpr int kTileRows = kFp8CastTileRows, kTileCols = kFp8CastTileCols;
constexpr int kTilePitch = kTileCols + 1;

// One 128 x 64 tile (number `tile` of x [rows, cols], col_tiles per tile row) of x cast with
// scale s to FP8 data [rows, cols] and, where data_t is given, its transpose [cols, rows], through
// shared memory; each thread moves V-element vectors (V = 8: 16-byte bf16 loads, 8-byte FP8
// stores). Returns this thread's amax of what it read.
template <typename T, int V, bool kAct = false>
__device__ __forceinline__ float cast_transpose_tile(const T* __restrict__ x,
                                                     uint8_t* __restrict__ data,
                                                     uint8_t* __restrict__ data_t, int64_t rows,
                                                     int64_t cols, int64_t tile, int64_t col_tiles,
                                                     float s, bool e4m3,
                                                     ActKind act = ActKind::kGelu) {
  constexpr int kLanes = kTileCols / V;            // threads per tile row
  constexpr int kRowsPerPass = kThreads / kLanes;  // tile rows per pass
  constexpr int kLanesT = kTileRows / V;           // threads per transposed row (a tile column)
  constexpr int kColsPerPass = kThreads / kLanesT;
  __shared__ uint8_t smem[kTileRows * kTilePitch];
  const int64_t r0 = tile / col_tiles * kTileRows, c0 = tile % col_tiles * kTileCols;
  const int lane = threadIdx.x % kLanes, row_in_pass = threadIdx.x / kLanes;
  float m = 0.f;
#pragma unroll
  for (int pass = 0; pass < kTileRows / kRowsPerPass; ++pass) {
    const int lr = row_in_pass + kRowsPerPass * pass;
    const int64_t r = r0 + lr, c = c0 + lane * V;
    if (r < rows && c < cols) {
      const auto v = cuda::load_vec<T, V>(x + r * cols + c);
      float f[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        f[j] = cast_input<T, kAct>(v.v[j], act);
        m = amax_with(m, f[j]);
        f[j] *= s;
      }
      cuda::Vec<uint8_t, V> q;
      fp8_pack(f, q.v, e4m3);
#pragma unroll
      for (int j = 0; j < V; ++j) smem[lr * kTilePitch + lane * V + j] = q.v[j];
      cuda::store_vec<uint8_t, V>(data + r * cols + c, q);
    }
  }
  if (data_t != nullptr) {
    __syncthreads();
    const int lane_t = threadIdx.x % kLanesT, col_in_pass = threadIdx.x / kLanesT;
#pragma unroll
    for (int pass = 0; pass < kTileCols / kColsPerPass; ++pass) {
      const int lc = col_in_pass + kColsPerPass * pass;
      const int64_t c = c0 + lc, r = r0 + lane_t * V;
      if (c < cols && r < rows) {
        cuda::Vec<uint8_t, V> q;
#pragma unroll
        for (int j = 0; j < V; ++j) q.v[j] = smem[(lane_t * V + j) * kTilePitch + lc];
        cuda::store_vec<uint8_t, V>(data_t + c * rows + r, q);
      }
    }
  }
  return m;
}

// x [rows, cols] (cols and, with data_t, rows multiples of V) to FP8 data and, where data_t is
// given, its transpose, one tile per block (of act(x) with kAct). The scale is *scale (delayed
// scaling; the tile's amax then goes into *amax) or comes from *amax (current scaling); block 0
// writes 1 / scale.
template <typename T, int V, bool kAct = false>
__global__ void cast_transpose_kernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                      uint8_t* __restrict__ data_t, int64_t rows, int64_t cols,
                                      int64_t col_tiles, float* __restrict__ amax,
                                      const float* __restrict__ scale,
                                      float* __restrict__ scale_inv, float fmax,
                                      float margin_factor, bool e4m3, ActKind act) {
  const float s = scale != nullptr ? *scale : scale_from(*amax, fmax, margin_factor, 1.f);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.f / s;
  const float m = cast_transpose_tile<T, V, kAct>(x, data, data_t, rows, cols, blockIdx.x,
                                                  col_tiles, s, e4m3, act);
  if (scale != nullptr) block_amax_into(m, amax);
}

// ---- Grouped casts (current scaling): x [T, cols] as groups of consecutive rows, each cast with
// the scale of its own amax, in two launches for all groups (an amax pass, then the cast).

// A launch's groups (at most kFP8MaxGroups, passed by value as a kernel argument): each group's
// first row (row_start[n]: the end of the last) and first block.
constexpr int kFP8MaxGroups = 64;
struct FP8GroupTable {
  int64_t row_start[kFP8MaxGroups + 1];
  int64_t block_start[kFP8MaxGroups];
  int n;
};

// Which group a block works on: the last g with start[g] <= b (start ascending, start[0] = 0).
__device__ __forceinline__ int group_of(const int64_t* start, int n, int64_t b) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// amax of each group into amax[g]: group g's rows are chunks of kAmaxChunkVecs vectors, one per
// block
// (table.block_start: the first block of each group).
constexpr int64_t kAmaxChunkVecs = kThreads * 8;
template <typename T, int VEC>
__global__ void grouped_amax_kernel(const T* __restrict__ x, int64_t cols, FP8GroupTable table,
                                    float* __restrict__ amax) {
  const int g = group_of(table.block_start, table.n, blockIdx.x);
  const int64_t end = (table.row_start[g + 1] * cols) / VEC;  // the group's vectors
  const int64_t chunk =
      (table.row_start[g] * cols) / VEC + (blockIdx.x - table.block_start[g]) * kAmaxChunkVecs;
  const float m =
      amax_of_vectors<T, VEC>(x, chunk + threadIdx.x, min(end, chunk + kAmaxChunkVecs), kThreads);
  block_amax_into(m, amax + g);
}

// Each group's tiles (table.block_start: the first tile of each group) cast with the scale of
// amax[g]; group g's transpose [cols, rows_g] is written at data_t + cols * row_start[g]. Block 0
// writes every group's 1 / scale (an empty group's too: 1).
template <typename T, int V>
__global__ void grouped_cast_transpose_kernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                              uint8_t* __restrict__ data_t, int64_t cols,
                                              int64_t col_tiles, FP8GroupTable table,
                                              const float* __restrict__ amax,
                                              float* __restrict__ scale_inv, float fmax,
                                              float margin_factor, bool e4m3) {
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < table.n; g += blockDim.x) {
      scale_inv[g] = 1.f / scale_from(amax[g], fmax, margin_factor, 1.f);
    }
  }
  const int g = group_of(table.block_start, table.n, blockIdx.x);
  const int64_t r0 = table.row_start[g], rows = table.row_start[g + 1] - r0;
  const float s = scale_from(amax[g], fmax, margin_factor, 1.f);
  cast_transpose_tile<T, V>(x + r0 * cols, data + r0 * cols,
                            data_t != nullptr ? data_t + r0 * cols : nullptr, rows, cols,
                            blockIdx.x - table.block_start[g], col_tiles, s, e4m3);
}

// history rolls by one (newest first) taking `now`; scale = fmax / (max or newest) * 2^-m, kept
// where that amax is 0 or not finite. An amax of 0 (an empty or all-zero tensor) leaves history
// and scale as they are, as te's update does. Every thread of one block of kUpdateThreads calls:
// the shift runs from the oldest end one block-wide chunk at a time (a chunk reads all it moves
// before it writes, and a younger chunk never reads what an older one wrote), so a 1024-entry
// history takes four steps, not 1024.
constexpr int kUpdateThreads = 256;
__device__ __forceinline__ void delayed_update(float* history, int64_t len, float now, float* scale,
                                               float fmax, float margin_factor, bool use_max) {
  if (now == 0.f) return;  // the same value in every thread: the block returns as one
  float m = now;
  for (int64_t end = len; end > 1; end -= kUpdateThreads) {
    const int64_t i = end - kUpdateThreads + threadIdx.x;
    float v = 0.f;
    if (i >= 1) {
      v = history[i - 1];
      m = fmaxf(m, v);
    }
    __syncthreads();
    if (i >= 1) history[i] = v;
  }
  if (threadIdx.x == 0) history[0] = now;
  m = cuda::block_max(m);
  if (threadIdx.x == 0) *scale = scale_from(use_max ? m : now, fmax, margin_factor, *scale);
}

__global__ void __launch_bounds__(kUpdateThreads)
    delayed_update_kernel(float* history, int64_t len, const float* amax_now, float* scale,
                          float fmax, float margin_factor, bool use_max) {
  delayed_update(history, len, *amax_now, scale, fmax, margin_factor, use_max);
}

// ---- One-launch cast (a small tensor, where launches and memsets, not bytes, cost the time):
// the blocks meet at a grid-wide barrier (a cooperative launch keeps them all resident), so the
// amax, the scale and the cast (or, delayed, the cast, the amax and the update) take one launch
// and no zeroed scratch: each block writes its partial amax to partial[blockIdx.x], and after the
// barrier every block reduces them.

// The max of partial[0, n) over the block; every thread gets it.
__device__ __forceinline__ float max_of_partials(const float* partial, int n) {
  float m = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, partial[i]);
  return cuda::block_max(m);
}

// cast_transpose_kernel's work over `tiles` tiles, grid-strided (gridDim.x <= tiles). Current
// scaling (scale null): amax(x) first, then the cast with its scale. Delayed: the cast with
// *scale, then block 0 updates history and scale with the cast's amax (every block read *scale
// before the barrier). Block 0 writes *scale_inv.
static_assert(kThreads == kUpdateThreads, "block 0 of the one-launch cast runs delayed_update");
template <typename T, int V, bool kAct = false>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_one_launch_kernel(const T* __restrict__ x, uint8_t* __restrict__ data,
                                     uint8_t* __restrict__ data_t, int64_t rows, int64_t cols,
                                     int64_t col_tiles, int64_t tiles, float* __restrict__ partial,
                                     float* scale, float* __restrict__ scale_inv, float* history,
                                     int64_t history_len, bool use_max, float fmax,
                                     float margin_factor, bool e4m3, ActKind act) {
  const auto grid = cooperative_groups::this_grid();
  float s;
  if (scale == nullptr) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const float m =
        amax_of_vectors<T, V, kAct>(x, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                                    rows * cols / V, stride, act);
    const float block_m = cuda::block_max(m);
    if (threadIdx.x == 0) partial[blockIdx.x] = block_m;
    grid.sync();
    s = scale_from(max_of_partials(partial, gridDim.x), fmax, margin_factor, 1.f);
  } else {
    s = *scale;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.f / s;
  float m = 0.f;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    __syncthreads();  // the previous tile's transpose may still read the shared tile
    m = fmaxf(m, cast_transpose_tile<T, V, kAct>(x, data, data_t, rows, cols, tile, col_tiles, s,
                                                 e4m3, act));
  }
  if (scale == nullptr) return;
  const float block_m = cuda::block_max(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = block_m;
  grid.sync();
  if (blockIdx.x != 0) return;
  const float now = max_of_partials(partial, gridDim.x);
  delayed_update(history, history_len, now, scale, fmax, margin_factor, use_max);
}

// Blocks of the one-launch kernel that fit on the device at once (its grid's upper bound), asked
// once per kernel, device and thread.
template <typename Kernel>
int64_t one_launch_capacity(Kernel kernel, int num_sms) {
  return static_cast<int64_t>(cuda::resident_blocks_here(kernel, kThreads)) * num_sms;
}

}  // namespace

namespace {

// Whether work on stream is being captured into a CUDA graph (the one-launch cast is then left
// out: a graph replays without host cost anyway, and capture keeps the plain launches).
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Launches kernel cooperatively (all its blocks resident at once) with args; false where the
// device declines (the error cleared: the caller takes the plain launches), and from then on
// for that kernel and device without asking again.
template <typename... Params, typename... Args>
bool launch_cooperative(void (*kernel)(Params...), int64_t blocks, cudaStream_t stream,
                        Args&&... args) {
  int device = 0;
  cudaGetDevice(&device);
  thread_local std::set<std::pair<const void*, int>> declined;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  if (declined.count(key) != 0) return false;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  const auto error = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (error == cudaSuccess) return true;
  cudaGetLastError();  // cleared: the plain launches run instead
  // Remembered only where the device refuses this cooperative launch; another error (one left
  // by an earlier launch) does not switch the path off for the process.
  if (error == cudaErrorCooperativeLaunchTooLarge || error == cudaErrorNotSupported) {
    declined.insert(key);
  }
  return false;
}

}  // namespace

void launch_fp8_cast(const void* x, void* data, void* data_t, int64_t rows, int64_t cols, bool e4m3,
                     double margin, float* amax, bool amax_given, float* scale, float* scale_inv,
                     float* history, int64_t history_len, bool use_max, KernelDType dtype,
                     int num_sms, cudaStream_t stream, const ActKind* act, float* partial) {
  const float fmax = fp8_max_of(e4m3);
  const float margin_factor = exp2f(-static_cast<float>(margin));
  const int64_t n = rows * cols;
  const int64_t col_tiles = cols > 0 ? (cols + kTileCols - 1) / kTileCols : 1;
  const int64_t tiles = n > 0 ? fp8_cast_tiles(rows, cols) : 1;
  const bool one_launch = partial != nullptr && !amax_given && n > 0 &&
                          (scale == nullptr || history != nullptr) && !capturing(stream);
  const ActKind act_kind = act ? *act : ActKind::kGelu;
  auto* d = static_cast<uint8_t*>(data);
  auto* dt = static_cast<uint8_t*>(data_t);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* tx = static_cast<const T*>(x);
    // 16-bit inputs in 8-element vectors (16 bytes) where the rows (and, transposing, the row
    // count) allow; else 4.
    const bool wide = sizeof(T) <= 2 && cols % 8 == 0 && (data_t == nullptr || rows % 8 == 0);
    const auto run = [&](auto plain_kernel, auto one_launch_kernel) {
      if (one_launch) {
        const int64_t blocks = std::min(fp8_cast_one_launch_blocks(rows, cols, num_sms),
                                        one_launch_capacity(one_launch_kernel, num_sms));
        if (launch_cooperative(one_launch_kernel, blocks, stream, tx, d, dt, rows, cols, col_tiles,
                               tiles, partial, scale, scale_inv, history, history_len, use_max,
                               fmax, margin_factor, e4m3, act_kind)) {
          return;
        }
      }
      if (!amax_given) cudaMemsetAsync(amax, 0, sizeof(float), stream);
      if (n > 0 && scale == nullptr && !amax_given) {  // current scaling: amax(x) first
        launch_amax(tx, n, amax, num_sms, stream, act);
      }
      plain_kernel<<<tiles, kThreads, 0, stream>>>(tx, d, dt, rows, cols, col_tiles, amax, scale,
                                                   scale_inv, fmax, margin_factor, e4m3, act_kind);
      cuda::check_launch("cast_transpose_kernel");
      if (history != nullptr) {
        delayed_update_kernel<<<1, kUpdateThreads, 0, stream>>>(history, history_len, amax, scale,
                                                                fmax, margin_factor, use_max);
        cuda::check_launch("delayed_update_kernel");
      }
    };
    const auto run_vec = [&](auto with_act) {
      constexpr bool kAct = decltype(with_act)::value;
      if (wide) {
        run(cast_transpose_kernel<T, 8, kAct>, cast_transpose_one_launch_kernel<T, 8, kAct>);
      } else {
        run(cast_transpose_kernel<T, 4, kAct>, cast_transpose_one_launch_kernel<T, 4, kAct>);
      }
    };
    if constexpr (kActLoads<T>) {
      if (act != nullptr) {
        run_vec(std::true_type{});
      } else {
        run_vec(std::false_type{});
      }
    } else {
      if (act != nullptr) {
        throw std::invalid_argument("launch_fp8_cast: an activation on load needs 16-bit data");
      }
      run_vec(std::false_type{});
    }
  });
}

void launch_fp8_qdq(const void* x, void* y, int64_t n, bool e4m3, double margin, float* amax,
                    float* scale, float* history, int64_t history_len, bool use_max,
                    KernelDType dtype, int num_sms, cudaStream_t stream) {
  const float fmax = fp8_max_of(e4m3);
  const float margin_factor = exp2f(-static_cast<float>(margin));
  cudaMemsetAsync(amax, 0, sizeof(float), stream);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* tx = static_cast<const T*>(x);
    if (n > 0) {
      launch_amax(tx, n, amax, num_sms, stream, nullptr);
      cuda::dispatch_vec<T>(n, {x, y}, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        const int64_t vecs = n / V;
        qdq_kernel<T, V><<<cuda::grid_for(vecs, kThreads, num_sms), kThreads, 0, stream>>>(
            tx, static_cast<T*>(y), vecs, amax, scale, fmax, margin_factor, e4m3);
      });
      cuda::check_launch("qdq_kernel");
    }
  });
  if (history != nullptr) {
    delayed_update_kernel<<<1, kUpdateThreads, 0, stream>>>(history, history_len, amax, scale, fmax,
                                                            margin_factor, use_max);
    cuda::check_launch("delayed_update_kernel");
  }
}

void launch_fp8_cast_grouped(const void* x, void* data, void* data_t, const int64_t* row_start,
                             int64_t num_groups, int64_t cols, bool e4m3, double margin,
                             float* amax, float* scale_inv, KernelDType dtype,
                             cudaStream_t stream) {
  const float fmax = fp8_max_of(e4m3);
  const float margin_factor = exp2f(-static_cast<float>(margin));
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  cudaMemsetAsync(amax, 0, sizeof(float) * num_groups, stream);
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto* tx = static_cast<const T*>(x);
    // 8-element vectors where every row (and, transposing, every group's row count) allows.
    bool wide = sizeof(T) <= 2 && cols % 8 == 0;
    for (int64_t g = 0; wide && data_t != nullptr && g < num_groups; ++g) {
      wide = (row_start[g + 1] - row_start[g]) % 8 == 0;
    }
    // At most kFP8MaxGroups groups per launch (the table travels as a kernel argument).
    for (int64_t g0 = 0; g0 < num_groups; g0 += kFP8MaxGroups) {
      FP8GroupTable amax_table, cast_table;
      const int n = static_cast<int>(std::min<int64_t>(kFP8MaxGroups, num_groups - g0));
      amax_table.n = cast_table.n = n;
      int64_t amax_blocks = 0, tiles = 0;
      const int64_t vec = wide ? 8 : 4;
      for (int g = 0; g <= n; ++g) {
        amax_table.row_start[g] = cast_table.row_start[g] = row_start[g0 + g] - row_start[g0];
        if (g == n) break;
        const int64_t rows = row_start[g0 + g + 1] - row_start[g0 + g];
        amax_table.block_start[g] = amax_blocks;
        cast_table.block_start[g] = tiles;
        amax_blocks += (rows * cols / vec + kAmaxChunkVecs - 1) / kAmaxChunkVecs;
        tiles += (rows + kTileRows - 1) / kTileRows * col_tiles;
      }
      const int64_t off = row_start[g0] * cols;
      auto* d = static_cast<uint8_t*>(data) + off;
      auto* dt = data_t != nullptr ? static_cast<uint8_t*>(data_t) + off : nullptr;
      const auto launch = [&](auto amax_kernel, auto cast_kernel) {
        if (amax_blocks > 0) {
          amax_kernel<<<amax_blocks, kThreads, 0, stream>>>(tx + off, cols, amax_table, amax + g0);
          cuda::check_launch("grouped_amax_kernel");
        }
        // Block 0 writes the scale_invs: at least one block, even with no rows at all.
        cast_kernel<<<std::max<int64_t>(tiles, 1), kThreads, 0, stream>>>(
            tx + off, d, dt, cols, col_tiles, cast_table, amax + g0, scale_inv + g0, fmax,
            margin_factor, e4m3);
        cuda::check_launch("grouped_cast_transpose_kernel");
      };
      if (wide) {
        launch(grouped_amax_kernel<T, 8>, grouped_cast_transpose_kernel<T, 8>);
      } else {
        launch(grouped_amax_kernel<T, 4>, grouped_cast_transpose_kernel<T, 4>);
      }
    }
  });
}

}  // namespace fusible::kernels

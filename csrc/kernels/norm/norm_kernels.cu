// LayerNorm and RMSNorm, forward and backward, in fp32 registers (fp64 for fp64) from the storage
// dtype. The forward: one block per row; the row is read from global memory once, kept in
// registers (a few vectors per thread; longer rows in shared memory as fp32) between the
// reductions and the write, and written once. The backward, for rows a block holds in registers:
// one pass; each block walks a fixed chunk of rows, writes dx row by row and sums its columns'
// weight and bias gradients as it goes into its own partial row, and a last kernel adds the
// partials in chunk order (deterministic). Longer rows: dx one block per row from shared memory,
// then a separate column pass over dy and x for the partials.
//
// x may be wider than the compute dtype T (X = float beside a 16-bit T: a float32 residual stream
// under autocast). The kernels then read it as it is and round each element to T on load, as a
// cast would, and the backward adds a float32 dextra and writes dx in float32, rounded once: no
// separate cast kernels on either side.
#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "kernels/common/cuda_common.cuh"
#include "kernels/norm/norm_launchers.h"

namespace fusible::kernels {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::load_vec;
using cuda::load_vec_pieces;
using cuda::store_vec;
using cuda::store_vec_pieces;
using cuda::to_acc;
using cuda::Vec;

constexpr int kMaxThreads = 1024;
// Vectors of a row each thread keeps in registers: all its loads are in flight at once (a block
// per row waits on its reductions, so bytes in flight per thread set the bandwidth). Measured on
// the H200 at [8192, 4096] bf16: the forward 45 us with 4 (85 us with 8, 69 us with the row in
// shared memory); the backward, four tensors' vectors within the 64 registers a 1024-thread block
// allows, 136 us with 1 and 156 us with 2 (weight and bias gradients included, as a second pass
// then).
constexpr int kFwdRegVecs = 4;
constexpr int kBwdRegVecs = 1;
// The forward over a wider x keeps as many bytes in flight in half the vectors (four spilled at
// the 64-register limit).
template <typename T, typename X>
constexpr int kFwdRegVecsOf = sizeof(X) > sizeof(T) ? kFwdRegVecs / 2 : kFwdRegVecs;
static_assert(kBwdRegVecs == 1, "norm_bwd_one_pass_kernel holds one vector of a row per thread");

// Where the kernels keep the row: in registers when a block of blockDim threads holds it.
template <int VEC, int NV>
__device__ __forceinline__ bool row_in_registers(int64_t cols) {
  return cols <= static_cast<int64_t>(blockDim.x) * VEC * NV;
}

// VEC elements of x at p as T: a wider X (float) rounded to T as a cast would.
template <typename T, int VEC, typename X>
__device__ __forceinline__ Vec<T, VEC> load_as(const X* p) {
  if constexpr (std::is_same_v<T, X>) {
    return load_vec<T, VEC>(p);
  } else {
    static_assert(std::is_same_v<X, float>, "a wider x is float32");
    const auto wide = load_vec_pieces<X, VEC>(p);
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = from_acc<T>(wide.v[j]);
    return out;
  }
}

// Element offset of a thread's k-th vector in the register layout (coalesced per k).
template <int VEC>
__device__ __forceinline__ int64_t reg_offset(int k) {
  return (static_cast<int64_t>(k) * blockDim.x + threadIdx.x) * VEC;
}

// The per-element formulas both row layouts (registers, shared memory) share.
// Forward: (x - mu) * rs * (gamma + shift), plus beta for LayerNorm (b: 0 for RMSNorm).
template <typename A>
__device__ __forceinline__ A norm_value(A x, A mu, A rs, A w, A shift, A b) {
  return (x - mu) * rs * (w + shift) + b;
}
// Backward: xhat and g = dy * (gamma + shift) of one element; dx from them and the row's means
// c1 of g (LayerNorm; 0 for RMSNorm) and c2 of g * xhat.
template <typename A>
struct NormGradTerms {
  A xh, g;
};
template <typename A>
__device__ __forceinline__ NormGradTerms<A> norm_grad_terms(A x, A dy, A w, A mu, A rs, A shift) {
  return {(x - mu) * rs, dy * (w + shift)};
}
template <typename A>
__device__ __forceinline__ A norm_dx(NormGradTerms<A> t, A rs, A c1, A c2) {
  return rs * (t.g - c1 - t.xh * c2);
}

template <typename T, typename X, int VEC, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd_kernel(const X* __restrict__ x,       // [rows, cols]
                    const T* __restrict__ weight,  // [cols]
                    const T* __restrict__ bias,    // [cols] (LayerNorm)
                    T* __restrict__ y,             // [rows, cols]
                    acc_t<T>* __restrict__ mean,   // [rows] (LayerNorm)
                    acc_t<T>* __restrict__ rstd,   // [rows]
                    float* __restrict__ amax,      // max |y| (zeroed before), or null
                    int64_t cols, acc_t<T> eps, bool zero_centered_gamma) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* row = reinterpret_cast<A*>(smem);  // this thread's elements only: no barrier needed
  const int64_t r = blockIdx.x;
  const X* xr = x + r * cols;
  const A shift = zero_centered_gamma ? A(1) : A(0);
  T* yr = y + r * cols;
  float m = 0.f;  // max |y| as stored (rounded), what a cast of y would find
  constexpr int NV = kFwdRegVecsOf<T, X>;
  if (row_in_registers<VEC, NV>(cols)) {
    Vec<T, VEC> xv[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (reg_offset<VEC>(k) < cols) xv[k] = load_as<T, VEC>(xr + reg_offset<VEC>(k));
    }
    A sum = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (reg_offset<VEC>(k) >= cols) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += to_acc(xv[k].v[j]);
    }
    const A mu = kLayerNorm ? cuda::block_sum(sum) / static_cast<A>(cols) : A(0);
    A sq = 0;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (reg_offset<VEC>(k) >= cols) continue;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A d = to_acc(xv[k].v[j]) - mu;
        sq += d * d;
      }
    }
    const A rs = A(1) / sqrt(cuda::block_sum(sq) / static_cast<A>(cols) + eps);
    if (threadIdx.x == 0) {
      if (kLayerNorm) mean[r] = mu;
      rstd[r] = rs;
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t i = reg_offset<VEC>(k);
      if (i >= cols) continue;
      const auto w = load_vec<T, VEC>(weight + i);
      Vec<T, VEC> b;
      if (kLayerNorm) b = load_vec<T, VEC>(bias + i);
      Vec<T, VEC> out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        out.v[j] = from_acc<T>(norm_value(to_acc(xv[k].v[j]), mu, rs, to_acc(w.v[j]), shift,
                                          kLayerNorm ? to_acc(b.v[j]) : A(0)));
        m = cuda::amax_with(m, static_cast<float>(to_acc(out.v[j])));
      }
      store_vec<T, VEC>(yr + i, out);
    }
    if (amax != nullptr) cuda::block_amax_into(m, amax);
    return;
  }
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  A sum = 0;
  for (int64_t i = threadIdx.x * VEC; i < cols; i += step) {
    const auto v = load_as<T, VEC>(xr + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      row[i + j] = to_acc(v.v[j]);
      sum += row[i + j];
    }
  }
  const A mu = kLayerNorm ? cuda::block_sum(sum) / static_cast<A>(cols) : A(0);
  A sq = 0;
  for (int64_t i = threadIdx.x * VEC; i < cols; i += step) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const A d = row[i + j] - mu;
      sq += d * d;
    }
  }
  const A rs = A(1) / sqrt(cuda::block_sum(sq) / static_cast<A>(cols) + eps);
  if (threadIdx.x == 0) {
    if (kLayerNorm) mean[r] = mu;
    rstd[r] = rs;
  }
  for (int64_t i = threadIdx.x * VEC; i < cols; i += step) {
    const auto w = load_vec<T, VEC>(weight + i);
    Vec<T, VEC> b;
    if (kLayerNorm) b = load_vec<T, VEC>(bias + i);
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      out.v[j] = from_acc<T>(norm_value(row[i + j], mu, rs, to_acc(w.v[j]), shift,
                                        kLayerNorm ? to_acc(b.v[j]) : A(0)));
      m = cuda::amax_with(m, static_cast<float>(to_acc(out.v[j])));
    }
    store_vec<T, VEC>(yr + i, out);
  }
  if (amax != nullptr) cuda::block_amax_into(m, amax);
}

// The backward of rows kept in registers (one vector per thread), in one pass: block c walks rows
// [c * rows_per_chunk, ...) one at a time, writes each row's dx (plus dextra), and sums dy * xhat
// and dy of its own columns as it goes; then partial[c] = [dweight | dbias], or, with one chunk,
// the totals straight into dweight and dbias. dy and x are read once. x, dextra and dx in X.
template <typename T, typename X, int VEC, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxThreads)
    norm_bwd_one_pass_kernel(const T* __restrict__ dy,           // [rows, cols]
                             const X* __restrict__ x,            // [rows, cols]
                             const acc_t<T>* __restrict__ mean,  // [rows] (LayerNorm)
                             const acc_t<T>* __restrict__ rstd,  // [rows]
                             const T* __restrict__ weight,       // [cols]
                             const X* __restrict__ dextra,       // [rows, cols] or null
                             X* __restrict__ dx,                 // [rows, cols]
                             acc_t<T>* __restrict__ partial,     // [chunks, 2 * cols] or null
                             T* __restrict__ dweight,            // [cols] when partial null
                             T* __restrict__ dbias,              // [cols] when partial null
                             int64_t rows, int64_t cols, int64_t rows_per_chunk,
                             bool zero_centered_gamma) {
  using A = acc_t<T>;
  const int64_t i = reg_offset<VEC>(0);
  const bool mine = i < cols;  // threads past the row only join the reductions
  const A shift = zero_centered_gamma ? A(1) : A(0);
  const A inv = A(1) / static_cast<A>(cols);
  A dw[VEC] = {}, db[VEC] = {};
  const int64_t row_begin = blockIdx.x * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const A mu = kLayerNorm ? mean[r] : A(0);
    const A rs = rstd[r];
    Vec<T, VEC> xv, dv, wv;
    Vec<X, VEC> ev;
    A sum_g = 0, sum_gx = 0;
    if (mine) {
      wv = load_vec<T, VEC>(weight + i);  // from cache after the first row: fewer registers held
      xv = load_as<T, VEC>(x + r * cols + i);
      dv = load_vec<T, VEC>(dy + r * cols + i);
      if (dextra != nullptr) ev = load_vec_pieces<X, VEC>(dextra + r * cols + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A d = to_acc(dv.v[j]);
        const auto t = norm_grad_terms(to_acc(xv.v[j]), d, to_acc(wv.v[j]), mu, rs, shift);
        sum_g += t.g;
        sum_gx += t.g * t.xh;
        dw[j] += d * t.xh;
        if (kLayerNorm) db[j] += d;
      }
    }
    if (kLayerNorm) {
      cuda::block_sum2(sum_g, sum_gx);
    } else {
      sum_gx = cuda::block_sum(sum_gx);
    }
    const A c1 = kLayerNorm ? sum_g * inv : A(0);
    const A c2 = sum_gx * inv;
    if (!mine) continue;
    Vec<X, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      // xhat and g recomputed: cheaper than keeping them in registers across the reductions.
      const auto t =
          norm_grad_terms(to_acc(xv.v[j]), to_acc(dv.v[j]), to_acc(wv.v[j]), mu, rs, shift);
      A o = norm_dx(t, rs, c1, c2);
      if (dextra != nullptr) o += to_acc(ev.v[j]);
      out.v[j] = from_acc<X>(o);
    }
    store_vec_pieces<X, VEC>(dx + r * cols + i, out);
  }
  if (!mine) return;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    if (partial != nullptr) {
      partial[blockIdx.x * 2 * cols + i + j] = dw[j];
      if (kLayerNorm) partial[blockIdx.x * 2 * cols + cols + i + j] = db[j];
    } else {
      dweight[i + j] = from_acc<T>(dw[j]);
      if (kLayerNorm) dbias[i + j] = from_acc<T>(db[j]);
    }
  }
}

// dx for one row per block (plus dextra), for rows too long for registers: xhat and g = dy * gamma
// kept in shared memory as fp32 between the reduction and the write.
template <typename T, typename X, int VEC, bool kLayerNorm>
__global__ void __launch_bounds__(kMaxThreads)
    norm_bwd_dx_kernel(const T* __restrict__ dy,           // [rows, cols]
                       const X* __restrict__ x,            // [rows, cols]
                       const acc_t<T>* __restrict__ mean,  // [rows] (LayerNorm)
                       const acc_t<T>* __restrict__ rstd,  // [rows]
                       const T* __restrict__ weight,       // [cols]
                       const X* __restrict__ dextra,       // [rows, cols] or null
                       X* __restrict__ dx,                 // [rows, cols]
                       int64_t cols, bool zero_centered_gamma) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  A* xhat = reinterpret_cast<A*>(smem);  // each thread touches only its own elements
  A* g = xhat + cols;
  const int64_t r = blockIdx.x;
  const int64_t step = static_cast<int64_t>(blockDim.x) * VEC;
  const A shift = zero_centered_gamma ? A(1) : A(0);
  const A mu = kLayerNorm ? mean[r] : A(0);
  const A rs = rstd[r];
  const A inv = A(1) / static_cast<A>(cols);
  A sum_g = 0, sum_gx = 0;
  for (int64_t i = threadIdx.x * VEC; i < cols; i += step) {
    const auto xv = load_as<T, VEC>(x + r * cols + i);
    const auto dv = load_vec<T, VEC>(dy + r * cols + i);
    const auto wv = load_vec<T, VEC>(weight + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const auto t =
          norm_grad_terms(to_acc(xv.v[j]), to_acc(dv.v[j]), to_acc(wv.v[j]), mu, rs, shift);
      xhat[i + j] = t.xh;
      g[i + j] = t.g;
      sum_g += t.g;
      sum_gx += t.g * t.xh;
    }
  }
  const A c1 = kLayerNorm ? cuda::block_sum(sum_g) * inv : A(0);
  const A c2 = cuda::block_sum(sum_gx) * inv;
  for (int64_t i = threadIdx.x * VEC; i < cols; i += step) {
    Vec<X, VEC> e;
    if (dextra != nullptr) e = load_vec_pieces<X, VEC>(dextra + r * cols + i);
    Vec<X, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A o = norm_dx(NormGradTerms<A>{xhat[i + j], g[i + j]}, rs, c1, c2);
      if (dextra != nullptr) o += to_acc(e.v[j]);
      out.v[j] = from_acc<X>(o);
    }
    store_vec_pieces<X, VEC>(dx + r * cols + i, out);
  }
}

constexpr int kColThreads = 32;
constexpr int kRowThreads = 8;

// The weight (dy * xhat) and bias (dy) gradients' partial column sums: block (32 x 8 threads, VEC
// adjacent columns each) sums one chunk of rows into partial[chunk] = [dweight | dbias], or, with
// one chunk, straight into dweight and dbias (no second pass). Fixed assignment, so the final sums
// are deterministic.
template <typename T, typename X, int VEC, bool kLayerNorm>
__global__ void norm_bwd_params_kernel(
    const T* __restrict__ dy,           // [rows, cols]
    const X* __restrict__ x,            // [rows, cols]
    const acc_t<T>* __restrict__ mean,  // [rows] (LayerNorm)
    const acc_t<T>* __restrict__ rstd,  // [rows]
    acc_t<T>* __restrict__ partial,     // [chunks, 2 * cols] or null
    T* __restrict__ dweight,            // [cols] when partial null
    T* __restrict__ dbias,              // [cols] when partial null
    int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  using A = acc_t<T>;
  __shared__ A tile[kRowThreads][kColThreads * VEC];
  const int64_t col = (blockIdx.x * static_cast<int64_t>(kColThreads) + threadIdx.x) * VEC;
  const int64_t row_begin = blockIdx.y * rows_per_chunk;
  const int64_t row_end = min(rows, row_begin + rows_per_chunk);
  A dw[VEC] = {}, db[VEC] = {};
  if (col < cols) {
#pragma unroll 4
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kRowThreads) {
      const A mu = kLayerNorm ? mean[r] : A(0);
      const A rs = rstd[r];
      const auto xv = load_as<T, VEC>(x + r * cols + col);
      const auto dv = load_vec<T, VEC>(dy + r * cols + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A d = to_acc(dv.v[j]);
        dw[j] += d * (to_acc(xv.v[j]) - mu) * rs;
        if (kLayerNorm) db[j] += d;
      }
    }
  }
  A* out = partial != nullptr ? partial + blockIdx.y * 2 * cols : nullptr;
  // Two rounds through the tile: the weight gradient, then the bias gradient.
  for (int round = 0; round < (kLayerNorm ? 2 : 1); ++round) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) tile[threadIdx.y][threadIdx.x * VEC + j] = round ? db[j] : dw[j];
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        A total = tile[0][threadIdx.x * VEC + j];
        for (int i = 1; i < kRowThreads; ++i) total += tile[i][threadIdx.x * VEC + j];
        if (out != nullptr) {
          out[round * cols + col + j] = total;
        } else {
          (round ? dbias : dweight)[col + j] = from_acc<T>(total);
        }
      }
    }
    __syncthreads();
  }
}

// Threads per row's block: enough for nv vectors each where a block of at most kMaxThreads holds
// the row so, else one vector each (up to kMaxThreads, the rest looped) with the row in shared
// memory. The forward kernel tells the two apart the same way (row_in_registers); the backward's
// launcher picks its kernel by it.
int threads_for(int64_t cols, int vec, int nv) {
  const int64_t vectors = (cols + vec - 1) / vec;
  const int64_t per_thread =
      vectors <= int64_t{kMaxThreads} * nv ? (vectors + nv - 1) / nv : vectors;
  const int64_t warps = std::min<int64_t>((per_thread + 31) / 32, kMaxThreads / 32);
  return static_cast<int>(std::max<int64_t>(warps, 1) * 32);
}

bool rows_in_registers(int64_t cols, int vec, int nv) {
  return cols <= int64_t{threads_for(cols, vec, nv)} * vec * nv;
}

size_t smem_bytes(int64_t cols, KernelDType dtype, bool backward) {
  const size_t acc = dtype == KernelDType::kFloat64 ? 8 : 4;
  const size_t rows_kept = backward ? 2 : 1;  // bwd: xhat and dy * gamma; fwd: x
  return rows_kept * static_cast<size_t>(cols) * acc;
}

// Static shared memory (block_sum's scratch) comes on top of the dynamic rows.
constexpr size_t kStaticSmemMargin = 1024;

// Raises the kernel's dynamic shared memory limit when, with the static part, it would pass the
// default 48 KiB. The limit is per kernel and device and only grows, so the driver call is made
// only when a launch needs more than was set before, not on every launch.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes + kStaticSmemMargin <= 48 * 1024) return;
  int device = 0;
  cudaGetDevice(&device);
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& set = allowed[{reinterpret_cast<const void*>(kernel), device}];
  if (bytes > set && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(bytes)) == cudaSuccess) {
    set = bytes;
  }
}

// Rows the one-pass backward gives a block at least: a block's partial row (2 * cols fp32,
// written, then read by the column sum) moves as many bytes as two rows of 16-bit dy and x, so
// fewer rows per chunk than this would spend more on partials than on the rows. (Not tuned.)
constexpr int64_t kMinRowsPerChunk = 4;

// The one-pass backward's grid for a row of V-element vectors: one wave of its blocks, each a
// chunk of rows.
template <typename T, typename X, int V, bool kLayerNorm>
int64_t one_pass_chunks(int64_t rows, int64_t cols, int num_sms) {
  const int threads = threads_for(cols, V, kBwdRegVecs);
  const int per_sm =
      cuda::resident_blocks_here(norm_bwd_one_pass_kernel<T, X, V, kLayerNorm>, threads);
  return std::max<int64_t>(1,
                           std::min<int64_t>(rows / kMinRowsPerChunk, int64_t{per_sm} * num_sms));
}

// The separate weight- and bias-gradient pass's row chunks: one wave of its blocks.
template <typename T, typename X, bool kLayerNorm>
int64_t params_pass_chunks(int64_t rows, int64_t cols, int num_sms) {
  constexpr int V = cuda::kVec16<T>;
  const int per_sm = cuda::resident_blocks_here(norm_bwd_params_kernel<T, X, V, kLayerNorm>,
                                                kColThreads * kRowThreads);
  return column_sum_chunks(rows, cols, num_sms, per_sm);
}

// f(T{}, X{}): the compute dtype's element type and x's, X = T or float beside a 16-bit T (any
// other pair throws: norm_reads_as_is turns those down first).
template <typename F>
void dispatch_x(KernelDType dtype, KernelDType x_dtype, F&& f) {
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      if (x_dtype == KernelDType::kFloat32) return f(tag, float{});
    }
    if (x_dtype != dtype) {
      throw std::invalid_argument(
          "norm kernels: x's dtype is neither the compute dtype nor float32");
    }
    f(tag, tag);
  });
}

// f(T{}, X{}, vector width, one_pass) for a backward over these pointers: the element types, the
// dx pass's vector width, and whether a block holds the row in registers (the one-pass kernel) or
// not (dx from shared memory, then the separate parameter pass). norm_bwd_chunks and
// launch_norm_bwd decide alike through it.
template <typename F>
void dispatch_bwd(KernelDType dtype, KernelDType x_dtype, int64_t cols,
                  std::initializer_list<const void*> ptrs, F&& f) {
  dispatch_x(dtype, x_dtype, [&](auto tag, auto xtag) {
    using T = decltype(tag);
    cuda::dispatch_vec<T>(cols, ptrs, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      f(tag, xtag, vec, rows_in_registers(cols, V, kBwdRegVecs));
    });
  });
}

}  // namespace

bool norm_fits(int64_t cols, KernelDType dtype, bool backward, int max_smem) {
  return smem_bytes(cols, dtype, backward) + kStaticSmemMargin <= static_cast<size_t>(max_smem);
}

void launch_norm_fwd(const void* x, const void* weight, const void* bias, void* y, void* mean,
                     void* rstd, float* amax, int64_t rows, int64_t cols, double eps,
                     bool zero_centered_gamma, bool layernorm, KernelDType dtype,
                     KernelDType x_dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  dispatch_x(dtype, x_dtype, [&](auto tag, auto xtag) {
    using T = decltype(tag);
    using X = decltype(xtag);
    using A = acc_t<T>;
    cuda::dispatch_vec<T>(cols, {x, weight, bias, y}, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      const auto kernel =
          layernorm ? norm_fwd_kernel<T, X, V, true> : norm_fwd_kernel<T, X, V, false>;
      const size_t smem =
          rows_in_registers(cols, V, kFwdRegVecsOf<T, X>) ? 0 : smem_bytes(cols, dtype, false);
      allow_smem(kernel, smem);
      kernel<<<rows, threads_for(cols, V, kFwdRegVecsOf<T, X>), smem, stream>>>(
          static_cast<const X*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
          static_cast<T*>(y), static_cast<A*>(mean), static_cast<A*>(rstd), amax, cols,
          static_cast<A>(eps), zero_centered_gamma);
    });
  });
  cuda::check_launch("norm_fwd_kernel");
}

int64_t norm_bwd_chunks(const void* dy, const void* x, const void* weight, const void* dextra,
                        const void* dx, int64_t rows, int64_t cols, bool layernorm,
                        KernelDType dtype, KernelDType x_dtype, int num_sms) {
  if (rows == 0 || cols == 0) return 0;
  int64_t chunks = 1;
  dispatch_bwd(dtype, x_dtype, cols, {dy, x, weight, dextra, dx},
               [&](auto tag, auto xtag, auto vec, bool one_pass) {
                 using T = decltype(tag);
                 using X = decltype(xtag);
                 constexpr int V = decltype(vec)::value;
                 if (one_pass) {
                   chunks = layernorm ? one_pass_chunks<T, X, V, true>(rows, cols, num_sms)
                                      : one_pass_chunks<T, X, V, false>(rows, cols, num_sms);
                 } else {
                   chunks = layernorm ? params_pass_chunks<T, X, true>(rows, cols, num_sms)
                                      : params_pass_chunks<T, X, false>(rows, cols, num_sms);
                 }
               });
  return chunks;
}

void launch_norm_bwd(const void* dy, const void* x, const void* mean, const void* rstd,
                     const void* weight, const void* dextra, void* dx, void* dweight, void* dbias,
                     void* workspace, int64_t rows, int64_t cols, int64_t num_chunks,
                     bool zero_centered_gamma, bool layernorm, KernelDType dtype,
                     KernelDType x_dtype, cudaStream_t stream) {
  if (cols == 0) return;
  const int64_t chunks = rows > 0 ? num_chunks : 0;  // no rows: the gradients are zeros
  // The partial rows hold [dweight | dbias]: one column sum writes both.
  const int64_t width = layernorm ? 2 * cols : cols;
  dispatch_bwd(
      dtype, x_dtype, cols, {dy, x, weight, dextra, dx},
      [&](auto tag, auto xtag, auto vec, bool one_pass) {
        using T = decltype(tag);
        using X = decltype(xtag);
        using A = acc_t<T>;
        constexpr int V = decltype(vec)::value;
        const auto* tdy = static_cast<const T*>(dy);
        const auto* tmean = static_cast<const A*>(mean);
        const auto* trstd = static_cast<const A*>(rstd);
        auto* partial = chunks > 1 ? static_cast<A*>(workspace) : nullptr;
        const int64_t rows_per_chunk = chunks > 0 ? (rows + chunks - 1) / chunks : 0;
        if (rows > 0 && one_pass) {
          const auto kernel = layernorm ? norm_bwd_one_pass_kernel<T, X, V, true>
                                        : norm_bwd_one_pass_kernel<T, X, V, false>;
          kernel<<<chunks, threads_for(cols, V, kBwdRegVecs), 0, stream>>>(
              tdy, static_cast<const X*>(x), tmean, trstd, static_cast<const T*>(weight),
              static_cast<const X*>(dextra), static_cast<X*>(dx), partial, static_cast<T*>(dweight),
              static_cast<T*>(dbias), rows, cols, rows_per_chunk, zero_centered_gamma);
          cuda::check_launch("norm_bwd_one_pass_kernel");
        } else if (rows > 0) {
          const auto* tx = static_cast<const X*>(x);
          const auto kernel =
              layernorm ? norm_bwd_dx_kernel<T, X, V, true> : norm_bwd_dx_kernel<T, X, V, false>;
          const size_t smem = smem_bytes(cols, dtype, true);
          allow_smem(kernel, smem);
          kernel<<<rows, threads_for(cols, V, kBwdRegVecs), smem, stream>>>(
              tdy, tx, tmean, trstd, static_cast<const T*>(weight), static_cast<const X*>(dextra),
              static_cast<X*>(dx), cols, zero_centered_gamma);
          cuda::check_launch("norm_bwd_dx_kernel");
          cuda::dispatch_vec<T>(cols, {dy, x}, [&](auto pvec) {
            constexpr int PV = decltype(pvec)::value;
            const dim3 grid((cols + kColThreads * PV - 1) / (kColThreads * PV), chunks);
            const dim3 block(kColThreads, kRowThreads);
            const auto params = layernorm ? norm_bwd_params_kernel<T, X, PV, true>
                                          : norm_bwd_params_kernel<T, X, PV, false>;
            params<<<grid, block, 0, stream>>>(tdy, tx, tmean, trstd, partial,
                                               static_cast<T*>(dweight), static_cast<T*>(dbias),
                                               rows, cols, rows_per_chunk);
          });
          cuda::check_launch("norm_bwd_params_kernel");
        }
        // Several chunks: their sums; no rows (no chunks): zeros.
        if (chunks != 1) {
          cuda::launch_column_sum<T>(workspace, dweight, width, chunks, 2 * cols, stream, dbias,
                                     cols);
        }
      });
}

}  // namespace fusible::kernels

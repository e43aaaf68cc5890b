// Device helpers shared by the raw CUDA kernels (.cu files only): the fp32 (fp64 for fp64)
// accumulation type, conversions, 16-byte vectors, block reductions, dtype dispatch and the launch
// check. No torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels::cuda {

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T v) {
  return static_cast<acc_t<T>>(v);
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
__device__ __forceinline__ T from_acc(acc_t<T> v) {
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

/// VEC elements of T loaded or stored as one access (16 bytes when VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, VEC>*>(p);
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, VEC>& v) {
  *reinterpret_cast<Vec<T, VEC>*>(p) = v;
}

/// load_vec / store_vec for data read or written once (a streaming pass larger than L2): the
/// evict-first cache policy (ld/st.global.cs) for 16-byte vectors, a plain access otherwise.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec_streaming(const T* p) {
  if constexpr (sizeof(Vec<T, VEC>) == 16) {
    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<const Vec<T, VEC>*>(&raw);
  } else {
    return load_vec<T, VEC>(p);
  }
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec_streaming(T* p, const Vec<T, VEC>& v) {
  if constexpr (sizeof(Vec<T, VEC>) == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else {
    store_vec<T, VEC>(p, v);
  }
}

/// Elements per 16-byte access of T.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

/// load_vec / store_vec for a vector that may span several 16-byte accesses (eight floats beside a
/// 16-bit type's eight-element vector): one access per 16 bytes, so p needs only their alignment.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_vec_pieces(const T* p) {
  constexpr int kPiece = VEC < kVec16<T> ? VEC : kVec16<T>;
  Vec<T, VEC> out;
#pragma unroll
  for (int h = 0; h < VEC; h += kPiece) {
    const auto piece = load_vec<T, kPiece>(p + h);
#pragma unroll
    for (int j = 0; j < kPiece; ++j) out.v[h + j] = piece.v[j];
  }
  return out;
}
template <typename T, int VEC>
__device__ __forceinline__ void store_vec_pieces(T* p, const Vec<T, VEC>& v) {
  constexpr int kPiece = VEC < kVec16<T> ? VEC : kVec16<T>;
#pragma unroll
  for (int h = 0; h < VEC; h += kPiece) {
    Vec<T, kPiece> piece;
#pragma unroll
    for (int j = 0; j < kPiece; ++j) piece.v[j] = v.v[h + j];
    store_vec<T, kPiece>(p + h, piece);
  }
}

/// Whether every pointer is 16-byte aligned and n a multiple of the vector width: the vector path.
inline bool can_vectorize(int64_t n, int vec, std::initializer_list<const void*> ptrs) {
  if (n % vec != 0) return false;
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

/// An access width for a kernel's template: VEC elements per step, moved as one 16-byte access
/// where `wide`, else one element at a time (a narrow width may equal T's 16-byte one: two
/// doubles).
template <int VEC, bool WIDE>
struct Width : std::integral_constant<int, VEC> {
  static constexpr bool wide = WIDE;
};

/// f(Width<16-byte width of T, true>) where `wide`, else f(Width<kNarrow, false>).
template <typename T, int kNarrow = 1, typename F>
void dispatch_width(bool wide, F&& f) {
  if (wide) {
    f(Width<kVec16<T>, true>{});
  } else {
    f(Width<kNarrow, false>{});
  }
}

/// dispatch_width on whether n and every pointer allow 16-byte accesses (can_vectorize).
template <typename T, typename F>
void dispatch_vec(int64_t n, std::initializer_list<const void*> ptrs, F&& f) {
  dispatch_width<T>(can_vectorize(n, kVec16<T>, ptrs), std::forward<F>(f));
}

/// x = the VEC elements at p: one 16-byte access where WIDE (p aligned to it), else one by one.
template <bool WIDE, typename T, int VEC>
__device__ __forceinline__ void load_elements(const T* p, T (&x)[VEC]) {
  if constexpr (WIDE) {
    const auto v = load_vec<T, VEC>(p);
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = v.v[e];
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) x[e] = p[e];
  }
}

/// The VEC elements at p = y, as load_elements reads them.
template <bool WIDE, typename T, int VEC>
__device__ __forceinline__ void store_elements(T* p, const T (&y)[VEC]) {
  if constexpr (WIDE) {
    Vec<T, VEC> v;
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = y[e];
    store_vec<T, VEC>(p, v);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) p[e] = y[e];
  }
}

/// m with |v| taken in, for an FP8 scale's amax: a NaN v is left out, as TransformerEngine's amax
/// (fmaxf) leaves it out, so it stays NaN in the cast without setting the other elements' scale
/// (the ATen reference's abs_max); an infinity counts.
__device__ __forceinline__ float amax_with(float m, float v) { return fmaxf(m, fabsf(v)); }

/// The block's max of every thread's m (>= 0, or +inf; never NaN) into *amax (zeroed by the caller
/// before the kernel): one atomic per block, skipped where *amax already holds as much. Any block
/// shape whose thread count is a multiple of 32; every thread of the block must call.
__device__ __forceinline__ void block_amax_into(float m, float* amax) {
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int warps = blockDim.x * blockDim.y * blockDim.z / 32;
  __syncthreads();  // an earlier call may still be reading warp_max
  if (tid % 32 == 0) warp_max[tid / 32] = m;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < warps; ++w) m = fmaxf(m, warp_max[w]);
    // Non-negative floats order as their bits do.
    if (m > *static_cast<volatile float*>(amax)) {
      atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
    }
  }
}

/// Two values reduced together (block_sum2): one shuffle and one scratch slot each per step.
template <typename A>
struct Pair {
  A a, b;
};
template <typename A>
__device__ __forceinline__ A shfl_xor(A v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
template <typename A>
__device__ __forceinline__ Pair<A> shfl_xor(Pair<A> v, int lane_mask) {
  return {shfl_xor(v.a, lane_mask), shfl_xor(v.b, lane_mask)};
}

/// op(v of every thread) over the block (blockDim.x a multiple of 32, at most 1024; `identity`:
/// op's neutral value); every thread gets the result. Safe to call repeatedly: it synchronizes
/// before reusing its shared scratch.
template <typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v, Op op, A identity) {
  __shared__ A scratch[32];
  for (int o = 16; o > 0; o /= 2) v = op(v, shfl_xor(v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  A total = lane < warps ? scratch[lane] : identity;
  for (int o = 16; o > 0; o /= 2) total = op(total, shfl_xor(total, o));
  return total;
}

/// Sum over the block (block_reduce's shape rules); every thread gets the total.
template <typename A>
__device__ __forceinline__ A block_sum(A v) {
  return block_reduce(
      v, [](A a, A b) { return a + b; }, A(0));
}

/// The sums of a and of b over the block, in one round of barriers for both (block_reduce's shape
/// rules and order, so each equals block_sum's); every thread gets them.
template <typename A>
__device__ __forceinline__ void block_sum2(A& a, A& b) {
  const Pair<A> total = block_reduce(
      Pair<A>{a, b},
      [](Pair<A> x, Pair<A> y) {
        return Pair<A>{x.a + y.a, x.b + y.b};
      },
      Pair<A>{A(0), A(0)});
  a = total.a;
  b = total.b;
}

/// Max over the block of non-negative floats (block_reduce's shape rules); every thread gets it.
__device__ __forceinline__ float block_max(float v) {
  return block_reduce(
      v, [](float a, float b) { return fmaxf(a, b); }, 0.f);
}

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) +
                             ": CUDA launch failed: " + cudaGetErrorString(err));
  }
}

/// f(T{}) with T the element type of dtype.
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

constexpr int kSumCols = 32;  // columns per block of column_sum_kernel, one per lane
constexpr int kSumRows = 8;   // warps per block, each over every 8th chunk

/// out[c] = sum over chunks of partial[chunk * stride + c]: the second pass of the column
/// reductions (bias and norm-parameter gradients); columns from `split` on go to out_hi[c - split]
/// instead (two gradients side by side in each partial row, one launch). Warp w sums chunks w,
/// w + 8, ... in order, then the warps' sums are added in warp order: deterministic, and many
/// blocks even for few columns (a thread per column walking every chunk left most SMs idle).
template <typename T>
__global__ void column_sum_kernel(const acc_t<T>* __restrict__ partial,  // [chunks, stride]
                                  T* __restrict__ out,                   // [split]
                                  T* __restrict__ out_hi,                // [cols - split]
                                  int64_t cols, int64_t split, int64_t chunks, int64_t stride) {
  __shared__ acc_t<T> tile[kSumRows][kSumCols];
  const int64_t col = blockIdx.x * static_cast<int64_t>(kSumCols) + threadIdx.x;
  acc_t<T> sum = 0;
  if (col < cols) {
#pragma unroll 4
    for (int64_t c = threadIdx.y; c < chunks; c += kSumRows) sum += partial[c * stride + col];
  }
  tile[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    acc_t<T> total = tile[0][threadIdx.x];
    for (int w = 1; w < kSumRows; ++w) total += tile[w][threadIdx.x];
    if (col < split) {
      out[col] = from_acc<T>(total);
    } else {
      out_hi[col - split] = from_acc<T>(total);
    }
  }
}

/// column_sum_kernel over cols columns of partial: out gets columns [0, split) and, where out_hi
/// is given, out_hi columns [split, cols) (split = cols without out_hi).
template <typename T>
void launch_column_sum(const void* partial, void* out, int64_t cols, int64_t chunks, int64_t stride,
                       cudaStream_t stream, void* out_hi = nullptr, int64_t split = -1) {
  if (cols == 0) return;
  const dim3 block(kSumCols, kSumRows);
  column_sum_kernel<T><<<(cols + kSumCols - 1) / kSumCols, block, 0, stream>>>(
      static_cast<const acc_t<T>*>(partial), static_cast<T*>(out), static_cast<T*>(out_hi), cols,
      out_hi != nullptr ? split : cols, chunks, stride);
  check_launch("column_sum_kernel");
}

/// Blocks of kernel (threads each, smem bytes of dynamic shared memory) resident on one SM at once,
/// at least 1: sizes grids of fixed work per block to whole waves.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, size_t smem = 0) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) !=
      cudaSuccess) {
    cudaGetLastError();  // clear it: a guess of one block costs speed, not correctness
    return 1;
  }
  return blocks > 0 ? blocks : 1;
}

/// resident_blocks of kernel on the current device, asked once per kernel, block size and device:
/// the occupancy query is a driver call, and GPUs of one machine may differ.
template <typename Kernel>
int resident_blocks_here(Kernel kernel, int threads) {
  int device = 0;
  cudaGetDevice(&device);
  // Per thread: no lock on a launch's host path (a thread asks at most once per key).
  thread_local std::map<std::tuple<const void*, int, int>, int> known;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, device);
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(key, resident_blocks(kernel, threads)).first;
  return it->second;
}

/// Grid size for a grid-stride loop over n items of block threads: enough blocks to fill every SM.
inline int64_t grid_for(int64_t n, int threads, int num_sms) {
  const int64_t need = (n + threads - 1) / threads;
  const int64_t fill = static_cast<int64_t>(num_sms) * (2048 / threads);
  return need < fill ? (need > 0 ? need : 1) : fill;
}

}  // namespace fusible::kernels::cuda

// Activations and the GLU family (plain, clamped, SiTU, per-row scaled), forward and backward,
// computed in fp32 registers (fp64 for fp64) from the storage dtype, written once in it.
#include <algorithm>

#include "kernels/activation/activation_launchers.h"
#include "kernels/activation/activation_math.cuh"
#include "kernels/common/cuda_map.cuh"

namespace fusible::kernels {
namespace {

using cuda::act_derivative;
using cuda::act_value;
using cuda::sigmoid;

using cuda::acc_t;
using cuda::from_acc;
using cuda::load_vec;
using cuda::store_vec;
using cuda::to_acc;
using cuda::Vec;

template <typename A, bool kFast>
struct ActFwd {
  ActKind kind;
  __device__ A operator()(A x, A) const { return act_value<A, kFast>(kind, x); }
};
template <typename A>
struct ActBwd {  // (dy, x) -> dy * act'(x)
  ActKind kind;
  __device__ A operator()(A dy, A x) const { return dy * act_derivative(kind, x); }
};

// One gated pair (a, b): the value and the partial derivatives.
template <typename A>
struct Gate {
  GluParams p;
  __device__ A value(A a, A b) const {
    switch (p.mode) {
      case GluMode::kPlain:
        return act_value(p.act, a) * b;
      case GluMode::kClamped: {
        const A lim = A(p.limit);
        const A ac = a < lim ? a : lim;
        const A bc = b < -lim ? -lim : (b > lim ? lim : b);
        return ac * sigmoid(A(p.alpha) * ac) * (bc + A(p.offset));
      }
      case GluMode::kSitu: {
        const A b1 = A(p.beta1), b2 = A(p.beta2);
        return b1 * cuda::tanh_(a / b1) * sigmoid(a) * b2 * cuda::tanh_(b / b2);
      }
    }
    return A(0);
  }
  // d value / da, d value / db.
  __device__ void grads(A a, A b, A& da, A& db) const {
    switch (p.mode) {
      case GluMode::kPlain:
        da = act_derivative(p.act, a) * b;
        db = act_value(p.act, a);
        return;
      case GluMode::kClamped: {
        const A lim = A(p.limit), al = A(p.alpha);
        const A ac = a < lim ? a : lim;
        const A bc = b < -lim ? -lim : (b > lim ? lim : b);
        const A s = sigmoid(al * ac);
        da = a <= lim ? (bc + A(p.offset)) * (s + al * ac * s * (A(1) - s)) : A(0);
        db = (b >= -lim && b <= lim) ? ac * s : A(0);
        return;
      }
      case GluMode::kSitu: {
        const A b1 = A(p.beta1), b2 = A(p.beta2);
        const A ta = cuda::tanh_(a / b1), tb = cuda::tanh_(b / b2), s = sigmoid(a);
        const A up = b2 * tb;
        da = up * ((A(1) - ta * ta) * s + b1 * ta * s * (A(1) - s));
        db = b1 * ta * s * (A(1) - tb * tb);
        return;
      }
    }
  }
  // value() and grads() from one activation evaluation where they share it (SwiGLU's sigmoid),
  // with their arithmetic: the results match theirs bit for bit.
  __device__ A value_and_grads(A a, A b, A& da, A& db) const {
    if (p.mode == GluMode::kPlain && p.act == ActKind::kSilu) {
      const A s = sigmoid(a);
      const A act = a * s;
      da = s * (A(1) + a * (A(1) - s)) * b;
      db = act;
      return act * b;
    }
    grads(a, b, da, db);
    return value(a, b);
  }
};

// Element e of the output [rows, h]: row e / h, column e % h; x holds [a | b] per row.
template <typename T, int VEC>
__global__ void glu_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t h,
                               Gate<acc_t<T>> gate, const acc_t<T>* __restrict__ scales) {
  using A = acc_t<T>;
  const int64_t vecs = rows * h / VEC;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = v * VEC, r = e / h, c = e % h;
    const auto av = load_vec<T, VEC>(x + r * 2 * h + c);
    const auto bv = load_vec<T, VEC>(x + r * 2 * h + h + c);
    const A s = scales != nullptr ? scales[r] : A(1);
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      o.v[j] = from_acc<T>(s * gate.value(to_acc(av.v[j]), to_acc(bv.v[j])));
    store_vec<T, VEC>(y + e, o);
  }
}

template <typename T, int VEC>
__global__ void glu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                               T* __restrict__ dx, int64_t rows, int64_t h, Gate<acc_t<T>> gate,
                               const acc_t<T>* __restrict__ scales) {
  using A = acc_t<T>;
  const int64_t vecs = rows * h / VEC;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = v * VEC, r = e / h, c = e % h;
    const auto dv = load_vec<T, VEC>(dy + e);
    const auto av = load_vec<T, VEC>(x + r * 2 * h + c);
    const auto bv = load_vec<T, VEC>(x + r * 2 * h + h + c);
    const A s = scales != nullptr ? scales[r] : A(1);
    Vec<T, VEC> da, db;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      A ga, gb;
      gate.grads(to_acc(av.v[j]), to_acc(bv.v[j]), ga, gb);
      const A d = s * to_acc(dv.v[j]);
      da.v[j] = from_acc<T>(d * ga);
      db.v[j] = from_acc<T>(d * gb);
    }
    store_vec<T, VEC>(dx + r * 2 * h + c, da);
    store_vec<T, VEC>(dx + r * 2 * h + h + c, db);
  }
}

// A scaled GLU's backward in one pass over dy and x, one block per row: dx as glu_bwd_kernel's
// and dscales[r] = sum over the row of dy * glu(a, b), summed in double (the terms cancel; a float
// sum over a wide row loses digits the float result keeps).
template <typename T, int VEC>
__global__ void scaled_glu_bwd_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                           T* __restrict__ dx, acc_t<T>* __restrict__ dscales,
                                           T* __restrict__ y, int64_t rows, int64_t h,
                                           Gate<acc_t<T>> gate,
                                           const acc_t<T>* __restrict__ scales) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const A s = scales[r];
    const T* xa = x + r * 2 * h;
    T* dxa = dx + r * 2 * h;
    double sum = 0;
    for (int64_t c = threadIdx.x * int64_t{VEC}; c < h; c += blockDim.x * int64_t{VEC}) {
      const auto dv = load_vec<T, VEC>(dy + r * h + c);
      const auto av = load_vec<T, VEC>(xa + c);
      const auto bv = load_vec<T, VEC>(xa + h + c);
      Vec<T, VEC> da, db, out;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const A a = to_acc(av.v[j]), b = to_acc(bv.v[j]), g = to_acc(dv.v[j]);
        A ga, gb;
        const A value = gate.value_and_grads(a, b, ga, gb);
        sum += g * value;
        out.v[j] = from_acc<T>(s * value);
        const A d = s * g;
        da.v[j] = from_acc<T>(d * ga);
        db.v[j] = from_acc<T>(d * gb);
      }
      store_vec<T, VEC>(dxa + c, da);
      store_vec<T, VEC>(dxa + h + c, db);
      if (y) store_vec<T, VEC>(y + r * h + c, out);
    }
    sum = cuda::block_sum(sum);
    if (threadIdx.x == 0) dscales[r] = static_cast<A>(sum);
  }
}

}  // namespace

void launch_activation_fwd(const void* x, void* y, int64_t n, ActKind act, KernelDType dtype,
                           int num_sms, cudaStream_t stream) {
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    // 16-bit data: the fast forms (activation_math.cuh), as the FP8 casts that apply the
    // activation on load (the same bytes either way).
    cuda::launch_map<T>(x, nullptr, y, n, ActFwd<acc_t<T>, sizeof(T) == 2>{act}, num_sms, stream,
                        "activation_fwd kernel");
  });
}

void launch_activation_bwd(const void* dy, const void* x, void* dx, int64_t n, ActKind act,
                           KernelDType dtype, int num_sms, cudaStream_t stream) {
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    cuda::launch_map<T>(dy, x, dx, n, ActBwd<acc_t<T>>{act}, num_sms, stream,
                        "activation_bwd kernel");
  });
}

void launch_glu_fwd(const void* x, void* y, int64_t rows, int64_t h, const GluParams& params,
                    const void* scales, KernelDType dtype, int num_sms, cudaStream_t stream) {
  if (rows * h == 0) return;
  constexpr int kThreads = 256;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const Gate<acc_t<T>> gate{params};
    const auto* ts = static_cast<const acc_t<T>*>(scales);
    const auto* tx = static_cast<const T*>(x);
    auto* ty = static_cast<T*>(y);
    cuda::dispatch_vec<T>(h, {x, y}, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      glu_fwd_kernel<T, V>
          <<<cuda::grid_for(rows * h / V, kThreads, num_sms), kThreads, 0, stream>>>(tx, ty, rows,
                                                                                     h, gate, ts);
    });
  });
  cuda::check_launch("glu_fwd_kernel");
}

void launch_glu_bwd(const void* dy, const void* x, void* dx, int64_t rows, int64_t h,
                    const GluParams& params, const void* scales, KernelDType dtype, int num_sms,
                    cudaStream_t stream) {
  if (rows * h == 0) return;
  constexpr int kThreads = 256;
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const Gate<acc_t<T>> gate{params};
    const auto* ts = static_cast<const acc_t<T>*>(scales);
    const auto* tdy = static_cast<const T*>(dy);
    const auto* tx = static_cast<const T*>(x);
    auto* tdx = static_cast<T*>(dx);
    cuda::dispatch_vec<T>(h, {dy, x, dx}, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      glu_bwd_kernel<T, V>
          <<<cuda::grid_for(rows * h / V, kThreads, num_sms), kThreads, 0, stream>>>(
              tdy, tx, tdx, rows, h, gate, ts);
    });
  });
  cuda::check_launch("glu_bwd_kernel");
}

void launch_scaled_glu_bwd(const void* dy, const void* x, void* dx, void* dscales, void* y,
                           int64_t rows, int64_t h, const GluParams& params, const void* scales,
                           KernelDType dtype, int num_sms, cudaStream_t stream) {
  if (rows == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{num_sms} * 16));
  cuda::dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    cuda::dispatch_vec<T>(h, {dy, x, dx, y}, [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      scaled_glu_bwd_rows_kernel<T, V><<<blocks, kThreads, 0, stream>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<T*>(dx),
          static_cast<A*>(dscales), static_cast<T*>(y), rows, h, Gate<A>{params},
          static_cast<const A*>(scales));
    });
  });
  cuda::check_launch("scaled_glu_bwd_rows_kernel");
}

}  // namespace fusible::kernels

// The activations and their derivatives on the device (.cu files only), in the accumulation type:
// the one definition the activation, GLU and bias-gradient kernels share.
#pragma once

#include <type_traits>

#include "kernels/activation/activation_launchers.h"

namespace fusible::kernels::cuda {

template <typename A>
__device__ __forceinline__ A exp_(A x) {
  if constexpr (std::is_same_v<A, float>) {
    return expf(x);
  } else {
    return exp(x);
  }
}
// kApprox: the SFU's tanh (relative error below 2^-10.9), for bf16 data, whose rounding (2^-9)
// hides it; tanhf's software sequence makes the GELU backward compute-bound on Hopper.
template <typename A, bool kApprox = false>
__device__ __forceinline__ A tanh_(A x) {
  if constexpr (std::is_same_v<A, float> && kApprox) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else if constexpr (std::is_same_v<A, float>) {
    return tanhf(x);
  } else {
    return tanh(x);
  }
}
template <typename A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + exp_(-x));
}

template <typename A>
__device__ __forceinline__ A act_value(ActKind k, A x) {
  switch (k) {
    case ActKind::kGelu:
      return A(0.5) * x * (A(1) + tanh_(A(kGeluC) * (x + A(kGeluA) * x * x * x)));
    case ActKind::kQGelu:
      return x * sigmoid(A(kQGeluAlpha) * x);
    case ActKind::kRelu:
      return x > A(0) ? x : A(0);
    case ActKind::kSRelu:
      return x > A(0) ? x * x : A(0);
    case ActKind::kSilu:
      return x * sigmoid(x);
    case ActKind::kSigmoid:
      return sigmoid(x);
  }
  return A(0);
}

template <typename A, bool kApprox = false>
__device__ __forceinline__ A act_derivative(ActKind k, A x) {
  switch (k) {
    case ActKind::kGelu: {
      const A t = tanh_<A, kApprox>(A(kGeluC) * (x + A(kGeluA) * x * x * x));
      return A(0.5) * (A(1) + t) +
             A(0.5) * x * (A(1) - t * t) * A(kGeluC) * (A(1) + A(3 * kGeluA) * x * x);
    }
    case ActKind::kQGelu: {
      const A s = sigmoid(A(kQGeluAlpha) * x);
      return s + A(kQGeluAlpha) * x * s * (A(1) - s);
    }
    case ActKind::kRelu:
      return x > A(0) ? A(1) : A(0);
    case ActKind::kSRelu:
      return x > A(0) ? A(2) * x : A(0);
    case ActKind::kSilu: {
      const A s = sigmoid(x);
      return s * (A(1) + x * (A(1) - s));
    }
    case ActKind::kSigmoid: {
      const A s = sigmoid(x);
      return s * (A(1) - s);
    }
  }
  return A(0);
}

}  // namespace fusible::kernels::cuda

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
template <typename A>
__device__ __forceinline__ A tanh_(A x) {
  if constexpr (std::is_same_v<A, float>) {
    return tanhf(x);
  } else {
    return tanh(x);
  }
}
template <typename A>
__device__ __forceinline__ A sigmoid(A x) {
  return A(1) / (A(1) + exp_(-x));
}
// kApprox: the SFU's exp and a fast division (relative error near 2^-21), for bf16 data.
template <typename A, bool kApprox = false>
__device__ __forceinline__ A sigmoid_(A x) {
  if constexpr (std::is_same_v<A, float> && kApprox) {
    return __fdividef(1.0f, 1.0f + __expf(-x));
  } else {
    return sigmoid(x);
  }
}

// kFast (16-bit data, fp32 math): GELU's tanh form as x * sigmoid(2u), with the SFU's exp and a
// fast division (relative error near 2^-21, far below bf16's 2^-8); tanhf costs several times
// more, which shows where the activation rides in a memory-bound pass (an FP8 cast's load).
template <typename A, bool kFast = false>
__device__ __forceinline__ A act_value(ActKind k, A x) {
  switch (k) {
    case ActKind::kGelu:
      if constexpr (kFast && std::is_same_v<A, float>) {
        return x * sigmoid_<A, true>(A(2) * A(kGeluC) * (x + A(kGeluA) * x * x * x));
      }
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
      // With s = sigmoid(2u) = (1 + tanh(u)) / 2: no cancellation where tanh(u) nears -1, the
      // tail where the derivative is small and 1 + tanh(u) would lose its relative accuracy.
      const A u = A(kGeluC) * (x + A(kGeluA) * x * x * x);
      const A s = sigmoid_<A, kApprox>(A(2) * u);
      return s + A(2) * x * s * (A(1) - s) * A(kGeluC) * (A(1) + A(3 * kGeluA) * x * x);
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

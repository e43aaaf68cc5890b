// The dtype the ATen reference kernels compute in: fp32 for fp16/bf16/fp32, fp64 for fp64. Rounding
// once at the end keeps the reference as accurate as a fused CUDA kernel that accumulates in fp32.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels {

inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

/// t in its accumulation dtype (no copy when it already is).
inline at::Tensor upcast(const at::Tensor& t) { return t.to(acc_dtype(t.scalar_type())); }

}  // namespace fusible::kernels

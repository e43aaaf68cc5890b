// The dtype the ATen reference kernels compute in: fp32 for fp16/bf16/fp32, fp64 for fp64. Rounding
// once at the end keeps the reference as accurate as a fused CUDA kernel that accumulates in fp32.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

namespace fusible::kernels {

inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

/// The partial sums of a column reduction over `chunks` row chunks ([chunks, width] in the
/// accumulation type of like), or none for one chunk: its kernel then writes the totals itself.
inline at::Tensor column_sum_workspace(int64_t chunks, int64_t width, const at::Tensor& like) {
  if (chunks <= 1) return {};
  return at::empty({chunks, width}, like.options().dtype(acc_dtype(like.scalar_type())));
}

/// t's data, or null for an undefined t (an optional workspace).
inline void* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr() : nullptr;
}

/// t in its accumulation dtype (no copy when it already is).
inline at::Tensor upcast(const at::Tensor& t) { return t.to(acc_dtype(t.scalar_type())); }

}  // namespace fusible::kernels

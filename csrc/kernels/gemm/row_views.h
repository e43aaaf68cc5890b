// The 2-D views the GEMM wrappers pass to cuBLASLt and the shapes they hand back.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels::gemm {

/// The 2-D row view a GEMM takes; a 2-D contiguous tensor as it is (a view per call costs host
/// time that shows in small calls).
inline at::Tensor rows(const at::Tensor& t) {
  if (t.dim() == 2 && t.is_contiguous()) return t;
  return t.contiguous().reshape({-1, t.size(-1)});
}

/// A GEMM's [M, N] result d in the leading shape of t (d itself when t is 2-D).
inline at::Tensor shaped_like(const at::Tensor& d, const at::Tensor& t) {
  if (t.dim() == 2) return d;
  auto shape = t.sizes().vec();
  shape.back() = d.size(1);
  return d.view(shape);
}

}  // namespace fusible::kernels::gemm

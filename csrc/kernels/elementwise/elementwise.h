// The residual add's checks and its ATen reference (CPU, Meta, and the CUDA path for mixed
// dtypes).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels::reference {

/// x and other floating, on one device, of one shape.
void check_add_args(const char* op, const at::Tensor& x, const at::Tensor& other);
/// x + other, computed in fp32 (fp64 for fp64), in x's dtype.
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other);
/// self += other, in self's storage and dtype.
void add_(const at::Tensor& self, const at::Tensor& other);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// elementwise.cpp.
namespace fusible::kernels {

at::Tensor scale_fwd(const at::Tensor& x, double scale);
/// x + other in x's dtype.
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other);
/// self += other in place.
void add_(const at::Tensor& self, const at::Tensor& other);

}  // namespace fusible::kernels

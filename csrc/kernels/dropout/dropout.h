// dropout_fwd / dropout_bwd: argument checks shared by the ATen reference (CPU, Meta) and the CUDA
// kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels::reference {

/// x floating, 0 <= p <= 1.
void check_dropout_fwd_args(const at::Tensor& x, double p);
/// dy floating; mask uint8 of ceil(dy.numel() / 8) bytes.
void check_dropout_bwd_args(const at::Tensor& dy, const at::Tensor& mask);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// dropout.cpp.
namespace fusible::kernels {

/// -> (y, keep mask).
std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p);
at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p);

}  // namespace fusible::kernels

// dropout_fwd / dropout_bwd: argument checks shared by the ATen reference (CPU, Meta) and the CUDA
// kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels::reference {

/// x floating, 0 <= p <= 1.
void check_dropout_fwd_args(const at::Tensor& x, double p);
/// dy floating; mask uint8 of ceil(dy.numel() / 8) bytes.
void check_dropout_bwd_args(const at::Tensor& dy, const at::Tensor& mask);

}  // namespace fusible::kernels::reference

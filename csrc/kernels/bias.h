// bias_fwd / bias_bwd: argument checks shared by the CPU, CUDA and Meta implementations.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels {

/// Checks x [..., N] and bias [N]: same device and dtype, floating, N matching.
void check_bias_fwd_args(const at::Tensor& x, const at::Tensor& bias);
/// Checks dy [..., N]: floating, at least 1-D.
void check_bias_bwd_args(const at::Tensor& dy);

}  // namespace fusible::kernels

// bias_fwd / bias_bwd: argument checks shared by the CPU, CUDA and Meta implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

namespace fusible::kernels {

/// Checks x [..., N] and bias [N]: same device and dtype, floating, N matching.
void check_bias_fwd_args(const at::Tensor& x, const at::Tensor& bias);
/// Checks dy [..., N]: floating, at least 1-D.
void check_bias_bwd_args(const at::Tensor& dy);

#ifdef FUSIBLE_WITH_CUDA
/// CUDA: dz <- dz * act'(pre) in place (both contiguous, one dtype and shape); returns dbias, the
/// sum of the new dz over its rows. One pass (the dgrad-then-activation path of
/// linear_dgrad_act_bias).
at::Tensor bias_act_bwd_in_place(const at::Tensor& dz, const at::Tensor& pre, c10::string_view act);
#endif

}  // namespace fusible::kernels

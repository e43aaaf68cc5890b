// Typed entry points to every torch.ops.fusible op for C++ callers. Each goes through the
// dispatcher, so C++ and Python get the same CPU / CUDA / Meta routing.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels {

/// y = x + bias. x: [..., N], bias: [N] -> [..., N].
at::Tensor bias_fwd(const at::Tensor& x, const at::Tensor& bias);
/// dbias = dy summed over leading dims. dy: [..., N] -> [N].
at::Tensor bias_bwd(const at::Tensor& dy);

}  // namespace fusible::kernels

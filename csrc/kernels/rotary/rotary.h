// qkv_rotary_fwd / qkv_rotary_bwd: rotary position embedding applied to a packed attention
// projection, fused with the split into heads (and, backward, with the packing of the gradients).
// Argument checks shared by the ATen reference (CPU, Meta) and the CUDA kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels::reference {

/// qkv [batch, seq, 3 * num_heads * head_dim] floating with a contiguous last dim; head_dim even;
/// cos, sin [>= seq, head_dim / 2] floating, on qkv's device.
void check_qkv_rotary_fwd_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t num_heads);
/// dq, dk, dv [batch, heads, seq, head_dim] of one dtype and device; cos, sin as above.
void check_qkv_rotary_bwd_args(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                               const at::Tensor& cos, const at::Tensor& sin);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher. Shapes and
// semantics: the schemas in rotary.cpp.
namespace fusible::kernels {

/// -> qk [batch, seq, 2, heads, head_dim]: q and k of qkv, each pair (2i, 2i + 1) of a head
/// rotated by the angle whose cosine and sine are cos[s, i], sin[s, i]. v is not copied: it is
/// qkv's last third as it stands.
at::Tensor qkv_rotary_fwd(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads);
/// The gradient of qkv [batch, seq, 3 * heads * head_dim] from those of q, k, v [batch, heads,
/// seq, head_dim] (any strides): q's and k's rotated back, v's copied, packed in one pass.
at::Tensor qkv_rotary_bwd(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& cos, const at::Tensor& sin);

}  // namespace fusible::kernels

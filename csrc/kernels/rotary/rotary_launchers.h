// Host launchers of the rotary family's raw kernels (rotary_kernels.cu). The cos / sin tables are
// contiguous [>= seq, head_dim / 2] in the accumulation type (fp32; fp64 for fp64 data).
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// The shape of a packed projection [batch, seq, 3 * heads * head_dim].
struct QkvShape {
  int64_t batch = 0, seq = 0, heads = 0, head_dim = 0;
};

/// q and k of a contiguous qkv rotated into out [batch, seq, 2, heads, head_dim] (contiguous).
void launch_qkv_rotary_fwd(const void* qkv, const void* cos, const void* sin, void* out,
                           const QkvShape& shape, KernelDType dtype, int num_sms,
                           cudaStream_t stream);

/// The gradients of q, k, v: [batch, heads, seq, head_dim] with a contiguous last dim and these
/// element strides of batch, head and position.
struct QkvGrads {
  const void* data[3] = {nullptr, nullptr, nullptr};
  int64_t batch_stride[3] = {0, 0, 0}, head_stride[3] = {0, 0, 0}, seq_stride[3] = {0, 0, 0};
};

/// dqkv [batch, seq, 3 * heads * head_dim] (contiguous): dq and dk rotated back, dv copied.
void launch_qkv_rotary_bwd(const QkvGrads& grads, const void* cos, const void* sin, void* dqkv,
                           const QkvShape& shape, KernelDType dtype, int num_sms,
                           cudaStream_t stream);

}  // namespace fusible::kernels

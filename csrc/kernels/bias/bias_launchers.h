// Host launchers of the bias family's raw kernels (bias_kernels.cu): pointers, sizes and a stream.
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// y[m, n] = x[m, n] + bias[n]; all contiguous, row-major.
void launch_bias_fwd(const void* x,     // [rows, cols]
                     const void* bias,  // [cols]
                     void* y,           // [rows, cols]
                     int64_t rows, int64_t cols, KernelDType dtype, int num_sms,
                     cudaStream_t stream);

/// Blocks per SM the (16-byte wide) bias-gradient kernel's row chunks are planned for, with or
/// without the activation's gradient: those resident at once, times the waves it runs in.
/// column_sum_chunks' blocks_per_sm for launch_bias_bwd and launch_bias_act_bwd.
int bias_grad_blocks_per_sm(bool act, KernelDType dtype);

/// Partial column sums of dy over row chunks, then their total: dbias[n] = sum_m dy[m, n].
/// workspace holds num_chunks * cols accumulator values (float, or double for kFloat64); with one
/// chunk the sums go straight to dbias and workspace may be null. Chunks: column_sum_chunks.
void launch_bias_bwd(const void* dy,   // [rows, cols]
                     void* workspace,  // [num_chunks, cols], accumulator type
                     void* dbias,      // [cols]
                     int64_t rows, int64_t cols, int64_t num_chunks, KernelDType dtype,
                     cudaStream_t stream);

/// dpre = dy * act'(pre) (dpre may be dy: in place) and dbias = dpre summed over rows, in one pass
/// plus the partials' sum; where amax is given (zeroed by the caller), max |dpre| into it (for an
/// FP8 cast of dpre). Chunks and workspace as launch_bias_bwd.
void launch_bias_act_bwd(const void* dy, const void* pre, void* dpre, void* workspace, void* dbias,
                         float* amax, int64_t rows, int64_t cols, int64_t num_chunks, ActKind act,
                         KernelDType dtype, cudaStream_t stream);

}  // namespace fusible::kernels

// Host launchers of the norm family's raw kernels (norm_kernels.cu): LayerNorm (layernorm = true:
// mean subtracted, bias added) and RMSNorm over rows of cols. Statistics and workspaces are in the
// accumulation type: float, or double for kFloat64. dtype is the compute dtype (weight, bias, y,
// dy, dweight, dbias); x_dtype that of x (and the backward's dextra and dx): dtype, or float32
// beside a 16-bit dtype where norm_reads_as_is (norm.h) says so (x rounded to dtype on load, as a
// cast would; dx rounded once, from the accumulation type).
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// Whether a row of cols fits the kernels' shared memory, max_smem bytes per block (the device's
/// opt-in limit); else the caller falls back.
bool norm_fits(int64_t cols, KernelDType dtype, bool backward, int max_smem);

/// How many row chunks launch_norm_bwd splits these rows into (its workspace holds one partial row
/// per chunk when more than one): one wave of the one-pass kernel where a block holds a row in
/// registers, else of the separate parameter pass; 0 without rows. The same pointers as the launch.
int64_t norm_bwd_chunks(const void* dy, const void* x, const void* weight, const void* dextra,
                        const void* dx, int64_t rows, int64_t cols, bool layernorm,
                        KernelDType dtype, KernelDType x_dtype, int num_sms);

void launch_norm_fwd(const void* x,       // [rows, cols]
                     const void* weight,  // [cols]
                     const void* bias,    // [cols], LayerNorm only
                     void* y,             // [rows, cols]
                     void* mean,          // [rows], LayerNorm only
                     void* rstd,          // [rows]
                     float* amax,         // [1]: max |y| (for an FP8 cast of y), zeroed by the
                                          // caller; or null
                     int64_t rows, int64_t cols, double eps, bool zero_centered_gamma,
                     bool layernorm, KernelDType dtype, KernelDType x_dtype, cudaStream_t stream);

/// dx (plus dextra when given), dweight and (LayerNorm) dbias.
void launch_norm_bwd(const void* dy,      // [rows, cols]
                     const void* x,       // [rows, cols]
                     const void* mean,    // [rows], LayerNorm only
                     const void* rstd,    // [rows]
                     const void* weight,  // [cols]
                     const void* dextra,  // [rows, cols] or null
                     void* dx,            // [rows, cols]
                     void* dweight,       // [cols]
                     void* dbias,         // [cols], LayerNorm only
                     void* workspace,     // [num_chunks, 2 * cols], accumulation type (chunks:
                                          // norm_bwd_chunks); null allowed for one chunk
                     int64_t rows, int64_t cols, int64_t num_chunks, bool zero_centered_gamma,
                     bool layernorm, KernelDType dtype, KernelDType x_dtype, cudaStream_t stream);

}  // namespace fusible::kernels

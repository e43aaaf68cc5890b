// Host launchers of the elementwise family's raw kernels (elementwise_kernels.cu): scale and
// residual add.
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// y = scale * x, n elements.
void launch_scale(const void* x, void* y, int64_t n, double scale, KernelDType dtype, int num_sms,
                  cudaStream_t stream);
/// out = a + b, n elements; out may be a (in place).
void launch_add(const void* a, const void* b, void* out, int64_t n, KernelDType dtype, int num_sms,
                cudaStream_t stream);

}  // namespace fusible::kernels

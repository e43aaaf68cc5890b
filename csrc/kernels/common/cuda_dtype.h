// Maps an ATen dtype to the raw kernels' KernelDType, with a clear error for the rest.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

inline KernelDType kernel_dtype(const char* op, const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return KernelDType::kFloat32;
    case at::kDouble:
      return KernelDType::kFloat64;
    case at::kHalf:
      return KernelDType::kFloat16;
    case at::kBFloat16:
      return KernelDType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, op, ": expected float32, float64, float16 or bfloat16, got ",
                       t.scalar_type());
  }
}

}  // namespace fusible::kernels

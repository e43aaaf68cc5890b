// FP8 device math shared by the per-tensor and the block-scaled cast kernels (.cu files only).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace fusible::kernels::cuda {

/// The largest finite E4M3 / E5M2 value (kernels::fp8_max on the host side).
constexpr float fp8_max_of(bool e4m3) { return e4m3 ? 448.f : 57344.f; }

/// m with |v| taken in; a NaN makes the amax non-finite (scale 1).
__device__ __forceinline__ float amax_with(float m, float v) {
  const float a = fabsf(v);
  return isnan(a) ? INFINITY : fmaxf(m, a);
}

/// v (already scaled) as FP8 bits, clamped to the format's range; NaN stays NaN.
__device__ __forceinline__ uint8_t fp8_bits(float v, float fmax, bool e4m3) {
  const float c = isnan(v) ? v : fminf(fmaxf(v, -fmax), fmax);
  return __nv_cvt_float_to_fp8(c, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

}  // namespace fusible::kernels::cuda

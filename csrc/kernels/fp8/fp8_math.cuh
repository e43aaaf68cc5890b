// FP8 device math shared by the per-tensor and the block-scaled cast kernels (.cu files only).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace fusible::kernels::cuda {

/// The largest finite E4M3 / E5M2 value (kernels::fp8_max on the host side).
constexpr float fp8_max_of(bool e4m3) { return e4m3 ? 448.f : 57344.f; }

/// v (already scaled) as FP8 bits: cvt's satfinite clamps to the format's finite range (infinities
/// included) and keeps NaN a NaN.
__device__ __forceinline__ uint8_t fp8_bits(float v, bool e4m3) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

/// Two values as fp8_bits in one conversion (Hopper converts pairs): a in the low byte.
__device__ __forceinline__ uint16_t fp8x2_bits(float a, float b, bool e4m3) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e4m3 ? __NV_E4M3 : __NV_E5M2);
}

/// V scaled values as FP8 bytes, converted in pairs (V even).
template <int V>
__device__ __forceinline__ void fp8_pack(const float (&v)[V], uint8_t (&out)[V], bool e4m3) {
#pragma unroll
  for (int j = 0; j < V; j += 2) {
    const uint16_t q = fp8x2_bits(v[j], v[j + 1], e4m3);
    memcpy(&out[j], &q, sizeof(q));  // little-endian: v[j] lands in out[j]
  }
}

}  // namespace fusible::kernels::cuda

// FP8 GEMM support by compute capability (fp8_support.h).
#include "kernels/fp8/fp8_support.h"

#include <atomic>

#ifdef FUSIBLE_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#endif

namespace fusible::kernels {
namespace {
std::atomic<int> override_major{-1}, override_minor{0};
}  // namespace

std::pair<bool, std::string> fp8_gemm_support(int major, int minor, bool block) {
  const auto cc = std::to_string(major) + "." + std::to_string(minor);
  if (major * 10 + minor < 89) {
    return {false, "FP8 GEMMs need compute capability 8.9 or newer, this GPU has " + cc};
  }
  if (block && major != 9) {
    return {false,
            "block-scaled FP8 GEMMs (Float8BlockScaling) run on Hopper (compute capability 9.x), "
            "this GPU has " +
                cc};
  }
  return {true, ""};
}

std::pair<int, int> cuda_capability(c10::DeviceIndex index) {
  if (const int major = override_major.load(); major >= 0) return {major, override_minor.load()};
#ifdef FUSIBLE_WITH_CUDA
  const auto* p =
      index < 0 ? at::cuda::getCurrentDeviceProperties() : at::cuda::getDeviceProperties(index);
  return {p->major, p->minor};
#else
  (void)index;
  return {0, 0};
#endif
}

void set_cuda_capability_override(int major, int minor) {
  override_minor.store(minor);
  override_major.store(major);
}

}  // namespace fusible::kernels

// Which FP8 GEMMs a GPU runs, by compute capability: the one place fusible decides it, read by the
// linears' FP8 plans (ops/quantization.cpp) and by fusible.fp8_available() and friends.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <utility>

namespace fusible::kernels {

/// (ok, why not) for cuBLASLt's FP8 GEMMs on compute capability major.minor: per-tensor scales
/// from 8.9 (Ada, Hopper, Blackwell); block scales (1x128 / 128x128, `block`) on Hopper (9.x)
/// only, as cuBLASLt offers them.
std::pair<bool, std::string> fp8_gemm_support(int major, int minor, bool block);

/// The compute capability of a CUDA device (major, minor; index -1: the current device); (0, 0)
/// where fusible was built without CUDA. A test override (set_cuda_capability_override) replaces
/// every device's.
std::pair<int, int> cuda_capability(c10::DeviceIndex index);

/// Makes cuda_capability report (major, minor) for every device, for tests of the gating on a
/// GPU that has the features; major < 0 removes the override. Process-wide.
void set_cuda_capability_override(int major, int minor);

}  // namespace fusible::kernels

// The norm family's argument checks and ATen reference implementations (CPU, Meta, and the CUDA
// fallback where a row does not fit the CUDA kernels' shared memory).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusible::kernels::reference {

/// x [..., *weight.shape] with weight floating, of x's dtype and device: the normalized dims
/// (negative indices).
std::vector<int64_t> check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight);
/// bias of weight's shape, x's dtype.
void check_norm_bias(const char* op, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& bias);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(const at::Tensor& x,
                                                             const at::Tensor& weight,
                                                             const at::Tensor& bias, double eps,
                                                             bool zero_centered_gamma);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma);
/// layernorm_fwd / rmsnorm_fwd plus max |y| ([1] fp32, as reference::amax_of): what the next
/// FP8 cast of y needs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_amax(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    bool zero_centered_gamma);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd_amax(const at::Tensor& x,
                                                                const at::Tensor& weight,
                                                                double eps,
                                                                bool zero_centered_gamma);
std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                               double eps, bool zero_centered_gamma);
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma);

/// The norm backward plus dextra added to dx, through the dispatched ops (each device's own
/// norm backward and add): what a device falls back to where its fused kernel does not run.
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra);

}  // namespace fusible::kernels::reference

namespace fusible::kernels {

/// Whether the norm kernels read an x of x_dtype as it is beside the compute (weight's) dtype: the
/// same dtype, or float32 beside bf16 / fp16 (rounded on load, dx written in float32). Other pairs
/// are converted to the compute dtype first, or (backward, CUDA) run the reference.
bool norm_reads_as_is(at::ScalarType x_dtype, at::ScalarType compute_dtype);

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// norm.cpp.
namespace fusible::kernels {

/// -> (rmsnorm_bwd's dx + dextra, dweight).
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra);
/// -> (layernorm_bwd's dx + dextra, dweight, dbias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra);
/// -> (y, mean, rstd), stats over x's leading dims.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_fwd(const at::Tensor& x,
                                                             const at::Tensor& weight,
                                                             const at::Tensor& bias, double eps,
                                                             bool zero_centered_gamma);
/// -> (dx, dweight, dbias).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma);
/// -> (y, rstd over x's leading dims).
std::tuple<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                               double eps, bool zero_centered_gamma);
/// layernorm_fwd -> (y, mean, rstd, max |y| as [1] fp32) in one pass: for an FP8 cast of y
/// (fp8_cast_with_amax).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_fwd_amax(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
    bool zero_centered_gamma);
/// rmsnorm_fwd -> (y, rstd, max |y| as [1] fp32) in one pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rmsnorm_fwd_amax(const at::Tensor& x,
                                                                const at::Tensor& weight,
                                                                double eps,
                                                                bool zero_centered_gamma);
/// -> (dx, dweight).
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma);
/// -> (y, rstd [...]).
std::tuple<at::Tensor, at::Tensor> l2norm_fwd(const at::Tensor& x, double eps);
at::Tensor l2norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd);

}  // namespace fusible::kernels

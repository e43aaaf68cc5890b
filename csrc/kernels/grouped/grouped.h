// The grouped GEMMs of GroupedLinear (grouped_linear_fwd / _dgrad / _wgrad, grouped_bias_bwd):
// argument checks shared by the CPU reference, the CUDA kernels and the Meta version.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels {

/// Checks x [T, K] against split_sizes (1-D int32 / int64 on x's device, one entry per group): the
/// metadata only; the values are checked where they are read (host on CPU, device on CUDA).
void check_grouped_rows(const char* op, const char* x_name, const at::Tensor& x,
                        const at::Tensor& split_sizes);
/// Checks weight [G, N, K] against x [T, in_dim] (in_dim = K for the forward, N for the dgrad).
void check_grouped_weight(const char* op, const char* x_name, const at::Tensor& x,
                          const at::Tensor& weight, const at::Tensor& split_sizes, int64_t in_dim);
/// Checks bias [G, N] and scales [T] (floating, on x's device) for grouped_linear_fwd.
void check_grouped_bias(const char* op, const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& scales);
/// Checks the scales [T]: floating, one per row of x, on x's device.
void check_grouped_scales(const char* op, const at::Tensor& x, const at::Tensor& scales);

/// Checks dy [T, N] and x [T, K] of grouped_linear_wgrad: one dtype, the same rows.
void check_grouped_wgrad(const char* op, const at::Tensor& dy, const at::Tensor& x,
                         const at::Tensor& split_sizes);
/// Checks grouped_bias_bwd's arguments: scales [T]; bias [G, N] (only with scales: their gradient).
void check_grouped_bias_bwd(const char* op, const at::Tensor& dy, const at::Tensor& split_sizes,
                            const std::optional<at::Tensor>& scales,
                            const std::optional<at::Tensor>& bias);

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// grouped.cpp.
namespace fusible::kernels {

/// GroupedLinear's grouped GEMMs (library.cpp): x [T, K] split by split_sizes [G] (on x's device).
at::Tensor grouped_linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& split_sizes, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& scales);
at::Tensor grouped_linear_dgrad(const at::Tensor& dy, const at::Tensor& weight,
                                const at::Tensor& split_sizes);
/// -> [G, N, K].
at::Tensor grouped_linear_wgrad(const at::Tensor& dy, const at::Tensor& x,
                                const at::Tensor& split_sizes);
/// -> (dbias [G, N], dscales [T] when bias is given, else [0]).
std::tuple<at::Tensor, at::Tensor> grouped_bias_bwd(const at::Tensor& dy,
                                                    const at::Tensor& split_sizes,
                                                    const std::optional<at::Tensor>& scales,
                                                    const std::optional<at::Tensor>& bias);

}  // namespace fusible::kernels

// Typed entry points to every torch.ops.fusible op for C++ callers. Each goes through the
// dispatcher, so C++ and Python get the same CPU / CUDA / Meta routing. Shapes as in library.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels {

/// y = x + bias. x: [..., N], bias: [N] -> [..., N].
at::Tensor bias_fwd(const at::Tensor& x, const at::Tensor& bias);
/// dbias = dy summed over leading dims. dy: [..., N] -> [N].
at::Tensor bias_bwd(const at::Tensor& dy);

/// y = x W^T (+ bias). x: [..., K], weight: [N, K] -> [..., N].
at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
/// dx = dy W. dy: [..., N] -> [..., K].
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight);
/// dW = dy^T x. -> [N, K].
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x);

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
/// -> (dx, dweight).
std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& rstd, const at::Tensor& weight,
                                               bool zero_centered_gamma);
/// -> (y, rstd [...]).
std::tuple<at::Tensor, at::Tensor> l2norm_fwd(const at::Tensor& x, double eps);
at::Tensor l2norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& rstd);

/// kind in {gelu, qgelu, relu, srelu, silu}.
at::Tensor activation_fwd(const at::Tensor& x, const std::string& kind);
at::Tensor activation_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind);
/// kind in {glu, geglu, qgeglu, reglu, sreglu, swiglu}. x: [..., 2H] -> [..., H].
at::Tensor glu_fwd(const at::Tensor& x, const std::string& kind);
at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind);
at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha);
at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit,
                              double alpha);
/// scales: x's shape without the last dim.
at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales);
/// -> (dx, dscales).
std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales);

at::Tensor scale_fwd(const at::Tensor& x, double scale);
/// x + other in x's dtype.
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other);
/// self += other in place.
void add_(const at::Tensor& self, const at::Tensor& other);
/// -> (y, keep mask).
std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p);
at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p);

}  // namespace fusible::kernels

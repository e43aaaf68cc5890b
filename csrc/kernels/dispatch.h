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
/// dx = alpha * dy W. dy: [..., N] -> [..., K].
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha = 1.0);
/// dW = alpha * dy^T x. -> [N, K].
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha = 1.0);

/// GEMMs with fused epilogues; act in {gelu, relu}.
/// -> (act(pre), pre) with pre = x W^T + bias.
std::tuple<at::Tensor, at::Tensor> linear_bias_act_fwd(const at::Tensor& x,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       const std::string& act);
/// act(x W^T + bias) alone, pre not kept: for ReLU (whose backward needs only the output) and
/// for forwards that need no backward.
at::Tensor linear_bias_act(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const std::string& act);
/// alpha * x W^T + bias + other (a new tensor).
at::Tensor linear_add(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& other, double alpha);
/// out += alpha * x W^T + bias.
void linear_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, double alpha);
/// alpha * dy W + other (a new tensor).
at::Tensor linear_dgrad_add(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& other,
                            double alpha);
/// -> (act'(pre) * (dy W), its sum over leading dims).
std::tuple<at::Tensor, at::Tensor> linear_dgrad_act_bias(const at::Tensor& dy,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& pre,
                                                         const std::string& act);
/// -> (act'(pre) * dy, its sum over leading dims).
/// bias_act_bwd in place: dy becomes dpre; -> dbias.
at::Tensor bias_act_bwd_(const at::Tensor& dy, const at::Tensor& pre, const std::string& act);
std::tuple<at::Tensor, at::Tensor> bias_act_bwd(const at::Tensor& dy, const at::Tensor& pre,
                                                const std::string& act);
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
at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha, double offset);
at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit, double alpha,
                              double offset);
at::Tensor situglu_fwd(const at::Tensor& x, double beta1, double beta2);
at::Tensor situglu_bwd(const at::Tensor& dy, const at::Tensor& x, double beta1, double beta2);
/// scales: x's shape without the last dim.
at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales);
/// -> (dx, dscales).
std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales);
/// scaled_swiglu_bwd plus y = scales * swiglu(x) from the same pass -> (dx, dscales, y).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_swiglu_bwd_fwd(const at::Tensor& dy,
                                                                     const at::Tensor& x,
                                                                     const at::Tensor& scales);
at::Tensor scaled_situglu_fwd(const at::Tensor& x, const at::Tensor& scales, double beta1,
                              double beta2);
std::tuple<at::Tensor, at::Tensor> scaled_situglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                      const at::Tensor& scales, double beta1,
                                                      double beta2);
at::Tensor scaled_clamped_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales, double limit,
                                     double alpha, double offset);
std::tuple<at::Tensor, at::Tensor> scaled_clamped_swiglu_bwd(const at::Tensor& dy,
                                                             const at::Tensor& x,
                                                             const at::Tensor& scales, double limit,
                                                             double alpha, double offset);

at::Tensor scale_fwd(const at::Tensor& x, double scale);
/// x + other in x's dtype.
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other);
/// self += other in place.
void add_(const at::Tensor& self, const at::Tensor& other);
/// -> (y, keep mask).
std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p);
at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p);

/// x cast to FP8 ("e4m3" / "e5m2", current scaling with margin) and back to x's dtype.
at::Tensor fp8_quantize_dequantize(const at::Tensor& x, const std::string& format,
                                   double margin = 0.0);

/// Delayed scaling: x cast with scale [1] and back; amax_history and scale updated in place.
at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, const std::string& format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, const std::string& amax_compute_algo);

/// Block scaling: 1x128 (block_dim 1) or 128x128 (2) blocks, each with its own scale.
at::Tensor fp8_quantize_dequantize_block(const at::Tensor& x, const std::string& format,
                                         int64_t block_dim, bool power_2_scale = true);

/// -> (FP8 data, its [K, M] transpose or empty, scale_inv [1]); current scaling.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast(const at::Tensor& x,
                                                        const std::string& format, double margin,
                                                        bool transpose);

/// fp8_cast with delayed scaling's scale; amax_history and scale updated in place.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_delayed(
    const at::Tensor& x, const std::string& format, const at::Tensor& amax_history,
    const at::Tensor& scale, double margin, const std::string& amax_compute_algo, bool transpose);

/// act(alpha * deq(a) @ deq(b)^T + bias + other) in out_dtype -> (d, pre-activation or empty).
std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                                            at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& other, double alpha,
                                            const std::string& act, bool save_pre, bool fast_accum,
                                            int64_t a_block = 0, int64_t b_block = 0);

/// Block-scaled FP8 cast -> (data, scale_inv, data_t, scale_inv_t) (kernels/fp8/fp8_block.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_cast_block(const at::Tensor& x,
                                                                          const std::string& format,
                                                                          int64_t block_dim,
                                                                          bool rowwise,
                                                                          bool columnwise);

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

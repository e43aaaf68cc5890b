// The linear family's argument checks and reference implementations (ATen; CPU, CUDA fallback and
// Meta), shared by linear_cuda.cpp (cuBLASLt through kernels/gemm/, falling back to them where
// cuBLASLt cannot run).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels::reference {

/// x [..., x_dim_size] against weight [N, K]: floating, same dtype and device.
void check_linear_args(const char* op, const char* x_name, const at::Tensor& x,
                       const at::Tensor& weight, int64_t x_dim_size, const char* expect);
/// linear_fwd's checks (bias [N], x's dtype and device).
void check_fwd_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias);
void check_wgrad_args(const at::Tensor& dy, const at::Tensor& x, const char* op = "linear_wgrad");
/// linear_wgrad_add_'s: the wgrad's, and out [dy features, x features] floating on dy's device.
void check_wgrad_add_args(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x);

at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha);
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha);
void linear_wgrad_add_(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x,
                       double alpha, double beta);
std::tuple<at::Tensor, at::Tensor> linear_bias_act_fwd(const at::Tensor& x,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view act);
at::Tensor linear_bias_act(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view act);
at::Tensor linear_add(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& other, double alpha);
void linear_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, double alpha);
at::Tensor linear_dgrad_add(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& other,
                            double alpha);
std::tuple<at::Tensor, at::Tensor> linear_dgrad_act_bias(const at::Tensor& dy,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& pre,
                                                         c10::string_view act);
/// The activations a GEMM epilogue applies: gelu (tanh) and relu.
void check_epilogue_act(const char* op, c10::string_view act);
/// `other` has `result`'s shape, dtype and device.
void check_other(const char* op, const char* name, const at::Tensor& other,
                 const at::Tensor& result);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// linear.cpp.
namespace fusible::kernels {

/// y = x W^T (+ bias). x: [..., K], weight: [N, K] -> [..., N].
at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
/// dx = alpha * dy W. dy: [..., N] -> [..., K].
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha = 1.0);
/// dW = alpha * dy^T x. -> [N, K].
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha = 1.0);
/// out = alpha * dy^T x + beta * out in place, accumulated in out's precision (fp32 main_grad).
void linear_wgrad_add_(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x,
                       double alpha = 1.0, double beta = 1.0);
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

}  // namespace fusible::kernels

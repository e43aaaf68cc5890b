// The linear family's argument checks and reference implementations (ATen; CPU, CUDA fallback and
// Meta), shared by linear_cuda.cpp (cuBLASLt through kernels/gemm/, falling back to them where
// cuBLASLt cannot run).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace fusible::kernels::reference {

/// x [..., x_dim_size] against weight [N, K]: floating, same dtype and device.
void check_linear_args(const char* op, const char* x_name, const at::Tensor& x,
                       const at::Tensor& weight, int64_t x_dim_size, const char* expect);
/// linear_fwd's checks (bias [N], x's dtype and device).
void check_fwd_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias);
void check_wgrad_args(const at::Tensor& dy, const at::Tensor& x);

at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha);
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha);
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

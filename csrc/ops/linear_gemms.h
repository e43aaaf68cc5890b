// The GEMMs of BasicLinear and the fused ops built on it, on GemmOperands: the fusible::linear_*
// kernels where the operands are high precision, fusible::fp8_gemm where they are FP8 data
// (Hopper's layout: the forward reads x and w, the dgrad dy and w's transpose, the wgrad the
// transposes of dy and x). One place decides which, so every fusion runs the same GEMMs unfused or
// fused.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>

#include "ops/quantization.h"

namespace fusible::ops::gemms {

/// x W^T (+ bias).
at::Tensor forward(const GemmOperand& x, const GemmOperand& w,
                   const std::optional<at::Tensor>& bias);

/// x W^T (+ bias) written into out [rows, N] (a view of a larger output, say): FP8 GEMMs write it
/// in place, others compute and copy.
void forward_into(const GemmOperand& x, const GemmOperand& w, const std::optional<at::Tensor>& bias,
                  const at::Tensor& out);

/// act(x W^T + bias) ("gelu" (tanh) or "relu") -> (y, the pre-activation where save_pre, else
/// undefined).
std::pair<at::Tensor, at::Tensor> forward_act(const GemmOperand& x, const GemmOperand& w,
                                              const std::optional<at::Tensor>& bias,
                                              const std::string& act, bool save_pre);

/// alpha * x W^T + bias + other; written into other where in_place and the GEMM can (FP8 GEMMs
/// write a new tensor): the result either way.
at::Tensor forward_add(const GemmOperand& x, const GemmOperand& w,
                       const std::optional<at::Tensor>& bias, const at::Tensor& other, double alpha,
                       bool in_place);

/// alpha * dy W.
at::Tensor dgrad(const GemmOperand& dy, const GemmOperand& w, double alpha = 1.0);

/// dy W written into out [rows, K], as forward_into writes.
void dgrad_into(const GemmOperand& dy, const GemmOperand& w, const at::Tensor& out);

/// alpha * dy W + other.
at::Tensor dgrad_add(const GemmOperand& dy, const GemmOperand& w, const at::Tensor& other,
                     double alpha = 1.0);

/// The dgrad through a bias + activation whose input was pre -> (dpre, dbias). With `amax` given
/// and FP8 GEMMs, *amax receives max |dpre| from the activation pass (else stays undefined).
std::pair<at::Tensor, at::Tensor> dgrad_act_bias(const GemmOperand& dy, const GemmOperand& w,
                                                 const at::Tensor& pre, const std::string& act,
                                                 at::Tensor* amax = nullptr);

/// alpha * dy^T x.
at::Tensor wgrad(const GemmOperand& dy, const GemmOperand& x, double alpha = 1.0);

/// alpha * dy^T x added into out (accumulate) or written into it, the product accumulated in
/// out's precision: a weight gradient into its fp32 main_grad with no rounding to the compute
/// dtype between (TransformerEngine's wgrad GEMM with beta = 1).
void wgrad_into(const GemmOperand& dy, const GemmOperand& x, const at::Tensor& out, double alpha,
                bool accumulate);

}  // namespace fusible::ops::gemms

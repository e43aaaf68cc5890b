// The linear GEMMs on high-precision or FP8 operands.
#include "ops/linear_gemms.h"

#include "kernels/ops.h"

namespace fusible::ops::gemms {
namespace {

// The FP8 GEMM a @ b^T of two FP8 operands' data, in a's compute dtype. Forward GEMMs use
// cuBLASLt's fast accumulation, the gradients' its exact one (TransformerEngine's choice).
std::pair<at::Tensor, at::Tensor> fp8(const at::Tensor& a, const GemmOperand& a_of,
                                      const at::Tensor& b, const GemmOperand& b_of,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& other, double alpha,
                                      const std::string& act, bool save_pre, bool fast_accum) {
  TORCH_CHECK(a.defined() && b.defined(), "FP8 GEMM: an operand was not cast for this use");
  auto [d, pre] = kernels::fp8_gemm(a, a_of.scale_inv, b, b_of.scale_inv, a_of.dtype, bias, other,
                                    alpha, act, save_pre, fast_accum);
  return {d, save_pre ? pre : at::Tensor()};
}

}  // namespace

at::Tensor forward(const GemmOperand& x, const GemmOperand& w,
                   const std::optional<at::Tensor>& bias) {
  if (!x.fp8()) return kernels::linear_fwd(x.rowwise, w.rowwise, bias);
  return fp8(x.rowwise, x, w.rowwise, w, bias, std::nullopt, 1.0, "none", false, true).first;
}

std::pair<at::Tensor, at::Tensor> forward_act(const GemmOperand& x, const GemmOperand& w,
                                              const std::optional<at::Tensor>& bias,
                                              const std::string& act, bool save_pre) {
  if (x.fp8()) return fp8(x.rowwise, x, w.rowwise, w, bias, std::nullopt, 1.0, act, save_pre, true);
  if (!save_pre) return {kernels::linear_bias_act(x.rowwise, w.rowwise, bias, act), at::Tensor()};
  auto [y, pre] = kernels::linear_bias_act_fwd(x.rowwise, w.rowwise, bias, act);
  return {y, pre};
}

at::Tensor forward_add(const GemmOperand& x, const GemmOperand& w,
                       const std::optional<at::Tensor>& bias, const at::Tensor& other, double alpha,
                       bool in_place) {
  if (x.fp8())
    return fp8(x.rowwise, x, w.rowwise, w, bias, other, alpha, "none", false, true).first;
  if (!in_place) return kernels::linear_add(x.rowwise, w.rowwise, bias, other, alpha);
  kernels::linear_add_(other, x.rowwise, w.rowwise, bias, alpha);
  return other;
}

at::Tensor dgrad(const GemmOperand& dy, const GemmOperand& w, double alpha) {
  if (!dy.fp8()) return kernels::linear_dgrad(dy.rowwise, w.rowwise, alpha);
  return fp8(dy.rowwise, dy, w.columnwise, w, std::nullopt, std::nullopt, alpha, "none", false,
             false)
      .first;
}

at::Tensor dgrad_add(const GemmOperand& dy, const GemmOperand& w, const at::Tensor& other,
                     double alpha) {
  if (!dy.fp8()) return kernels::linear_dgrad_add(dy.rowwise, w.rowwise, other, alpha);
  return fp8(dy.rowwise, dy, w.columnwise, w, std::nullopt, other, alpha, "none", false, false)
      .first;
}

std::pair<at::Tensor, at::Tensor> dgrad_act_bias(const GemmOperand& dy, const GemmOperand& w,
                                                 const at::Tensor& pre, const std::string& act) {
  if (!dy.fp8()) {
    auto [dpre, dbias] = kernels::linear_dgrad_act_bias(dy.rowwise, w.rowwise, pre, act);
    return {dpre, dbias};
  }
  // In place on the GEMM's output: one [tokens, features] buffer fewer at the backward's peak.
  auto dpre = dgrad(dy, w);
  auto dbias = kernels::bias_act_bwd_(dpre, pre, act);
  return {dpre, dbias};
}

at::Tensor wgrad(const GemmOperand& dy, const GemmOperand& x, double alpha) {
  if (!dy.fp8()) return kernels::linear_wgrad(dy.columnwise, x.columnwise, alpha);
  return fp8(dy.columnwise, dy, x.columnwise, x, std::nullopt, std::nullopt, alpha, "none", false,
             false)
      .first;
}

}  // namespace fusible::ops::gemms

// The linear GEMMs on high-precision or FP8 operands.
#include "ops/linear_gemms.h"

#include <tuple>

#include "kernels/dispatch.h"

namespace fusible::ops::gemms {
namespace {

// The FP8 GEMM a @ b^T of two FP8 operands' data (each with its scale_inv and block code), in
// a's compute dtype. Forward GEMMs use cuBLASLt's fast accumulation, the gradients' its exact one
// (TransformerEngine's choice; block-scaled GEMMs take no fast accumulation).
struct Fp8Side {
  const at::Tensor& data;
  const at::Tensor& scale_inv;
  int64_t block;
};

void check_cast(const Fp8Side& a, const Fp8Side& b) {
  TORCH_CHECK(
      a.data.defined() && b.data.defined() && a.scale_inv.defined() && b.scale_inv.defined(),
      "FP8 GEMM: an operand was not cast for this use");
}

std::pair<at::Tensor, at::Tensor> fp8(const Fp8Side& a, const Fp8Side& b, at::ScalarType dtype,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& other, double alpha,
                                      const std::string& act, bool save_pre, bool fast_accum) {
  check_cast(a, b);
  auto [d, pre] = kernels::fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, dtype, bias, other,
                                    alpha, act, save_pre, fast_accum, a.block, b.block);
  return {d, save_pre ? pre : at::Tensor()};
}

// The same written into out (forward_into, dgrad_into), or added to it (wgrad_into).
void fp8_into(const Fp8Side& a, const Fp8Side& b, const std::optional<at::Tensor>& bias,
              const at::Tensor& out, bool fast_accum, double alpha = 1.0, bool accumulate = false) {
  check_cast(a, b);
  kernels::fp8_gemm_out(a.data, a.scale_inv, b.data, b.scale_inv, out, bias, alpha, fast_accum,
                        a.block, b.block, accumulate);
}

// The three uses (Hopper reads K contiguous): the forward's rows, the transposes the gradients'
// GEMMs read.
Fp8Side rows(const GemmOperand& o) { return {o.rowwise, o.scale_inv, o.block}; }
Fp8Side cols(const GemmOperand& o) { return {o.columnwise, o.columnwise_scale_inv, o.block}; }

}  // namespace

at::Tensor forward(const GemmOperand& x, const GemmOperand& w,
                   const std::optional<at::Tensor>& bias) {
  if (!x.fp8()) return kernels::linear_fwd(x.rowwise, w.rowwise, bias);
  return fp8(rows(x), rows(w), x.dtype, bias, std::nullopt, 1.0, "none", false, true).first;
}

void forward_into(const GemmOperand& x, const GemmOperand& w, const std::optional<at::Tensor>& bias,
                  const at::Tensor& out) {
  if (!x.fp8()) {
    out.copy_(forward(x, w, bias));
    return;
  }
  fp8_into(rows(x), rows(w), bias, out, /*fast_accum=*/true);
}

std::pair<at::Tensor, at::Tensor> forward_act(const GemmOperand& x, const GemmOperand& w,
                                              const std::optional<at::Tensor>& bias,
                                              const std::string& act, bool save_pre) {
  if (x.fp8()) return fp8(rows(x), rows(w), x.dtype, bias, std::nullopt, 1.0, act, save_pre, true);
  if (!save_pre) return {kernels::linear_bias_act(x.rowwise, w.rowwise, bias, act), at::Tensor()};
  auto [y, pre] = kernels::linear_bias_act_fwd(x.rowwise, w.rowwise, bias, act);
  return {y, pre};
}

at::Tensor forward_add(const GemmOperand& x, const GemmOperand& w,
                       const std::optional<at::Tensor>& bias, const at::Tensor& other, double alpha,
                       bool in_place) {
  if (x.fp8()) {
    auto d = fp8(rows(x), rows(w), x.dtype, bias, other, alpha, "none", false, true).first;
    if (!in_place) return d;
    other.copy_(d.reshape(other.sizes()));  // the caller's tensor holds the sum, as asked
    return other;
  }
  if (!in_place) return kernels::linear_add(x.rowwise, w.rowwise, bias, other, alpha);
  kernels::linear_add_(other, x.rowwise, w.rowwise, bias, alpha);
  return other;
}

at::Tensor dgrad(const GemmOperand& dy, const GemmOperand& w, double alpha) {
  if (!dy.fp8()) return kernels::linear_dgrad(dy.rowwise, w.rowwise, alpha);
  return fp8(rows(dy), cols(w), dy.dtype, std::nullopt, std::nullopt, alpha, "none", false, false)
      .first;
}

void dgrad_into(const GemmOperand& dy, const GemmOperand& w, const at::Tensor& out) {
  if (!dy.fp8()) {
    out.copy_(dgrad(dy, w));
    return;
  }
  fp8_into(rows(dy), cols(w), std::nullopt, out, /*fast_accum=*/false);
}

at::Tensor dgrad_add(const GemmOperand& dy, const GemmOperand& w, const at::Tensor& other,
                     double alpha) {
  if (!dy.fp8()) return kernels::linear_dgrad_add(dy.rowwise, w.rowwise, other, alpha);
  return fp8(rows(dy), cols(w), dy.dtype, std::nullopt, other, alpha, "none", false, false).first;
}

std::pair<at::Tensor, at::Tensor> dgrad_act_bias(const GemmOperand& dy, const GemmOperand& w,
                                                 const at::Tensor& pre, const std::string& act,
                                                 at::Tensor* amax) {
  if (!dy.fp8()) {
    auto [dpre, dbias] = kernels::linear_dgrad_act_bias(dy.rowwise, w.rowwise, pre, act);
    return {dpre, dbias};
  }
  // In place on the GEMM's output: one [tokens, features] buffer fewer at the backward's peak.
  auto dpre = dgrad(dy, w);
  at::Tensor dbias;
  if (amax != nullptr) {
    std::tie(dbias, *amax) = kernels::bias_act_bwd_amax_(dpre, pre, act);
  } else {
    dbias = kernels::bias_act_bwd_(dpre, pre, act);
  }
  return {dpre, dbias};
}

at::Tensor wgrad(const GemmOperand& dy, const GemmOperand& x, double alpha) {
  if (!dy.fp8()) return kernels::linear_wgrad(dy.columnwise, x.columnwise, alpha);
  return fp8(cols(dy), cols(x), dy.dtype, std::nullopt, std::nullopt, alpha, "none", false, false)
      .first;
}

void wgrad_into(const GemmOperand& dy, const GemmOperand& x, const at::Tensor& out, double alpha,
                bool accumulate) {
  const double beta = accumulate ? 1.0 : 0.0;
  if (!dy.fp8()) return kernels::linear_wgrad_add_(out, dy.columnwise, x.columnwise, alpha, beta);
  fp8_into(cols(dy), cols(x), std::nullopt, out, /*fast_accum=*/false, alpha, accumulate);
}

}  // namespace fusible::ops::gemms

// The ops behind the fused ops (GEMMs with epilogues, bias + activation backward, norm backward
// with the residual gradient): their reference implementation composes the basic kernel ops, so it
// rounds as the unfused ops do and runs on CPU, CUDA and Meta. CUDA gets its own kernels (cuBLASLt
// epilogues) registered under the CUDA key.
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/linear.h"
#include "kernels/norms.h"
#include "kernels/ops.h"

namespace fusible::kernels {
namespace reference {

void check_epilogue_act(const char* op, c10::string_view act) {
  TORCH_CHECK_VALUE(act == "gelu" || act == "relu", op, ": expected act in {gelu, relu}, got '",
                    act, "'");
}

void check_other(const char* op, const char* name, const at::Tensor& other,
                 const at::Tensor& result) {
  TORCH_CHECK(other.sym_sizes().equals(result.sym_sizes()), op, ": expected ", name, " of shape ",
              result.sym_sizes(), ", got ", other.sym_sizes());
  FUSIBLE_CHECK_SAME_DTYPE(op, "the result", result, name, other);
  FUSIBLE_CHECK_SAME_DEVICE(op, "the result", result, name, other);
}

namespace {

// alpha * x W^T + bias.
at::Tensor scaled_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, double alpha) {
  if (alpha == 1.0) return linear_fwd(x, weight, bias);
  auto y = scale_fwd(linear_fwd(x, weight, std::nullopt), alpha);
  return bias ? bias_fwd(y, *bias) : y;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_bias_act_fwd(const at::Tensor& x,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view act) {
  check_epilogue_act("linear_bias_act_fwd", act);
  auto pre = linear_fwd(x, weight, bias);
  auto y = activation_fwd(pre, std::string(act));
  return {std::move(y), std::move(pre)};
}

at::Tensor linear_bias_act(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view act) {
  check_epilogue_act("linear_bias_act", act);
  return activation_fwd(linear_fwd(x, weight, bias), std::string(act));
}

at::Tensor linear_add(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& other,
                      double alpha) {
  auto y = scaled_linear(x, weight, bias, alpha);
  check_other("linear_add", "other", other, y);
  return add_fwd(y, other);
}

void linear_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, double alpha) {
  const auto y = scaled_linear(x, weight, bias, alpha);
  check_other("linear_add_", "out", out, y);
  add_(out, y);
}

at::Tensor linear_dgrad_add(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& other,
                            double alpha) {
  auto dx = linear_dgrad(dy, weight, alpha);
  check_other("linear_dgrad_add", "other", other, dx);
  return add_fwd(dx, other);
}

std::tuple<at::Tensor, at::Tensor> linear_dgrad_act_bias(const at::Tensor& dy,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& pre,
                                                         c10::string_view act) {
  check_epilogue_act("linear_dgrad_act_bias", act);
  return kernels::bias_act_bwd(kernels::linear_dgrad(dy, weight), pre, std::string(act));
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra) {
  auto [dx, dw] = kernels::rmsnorm_bwd(dy, x, rstd, weight, zero_centered_gamma);
  return {kernels::add_fwd(dx, dextra), std::move(dw)};  // in dx's dtype; add_fwd checks the shape
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra) {
  auto [dx, dw, db] = kernels::layernorm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma);
  return {kernels::add_fwd(dx, dextra), std::move(dw), std::move(db)};
}

}  // namespace reference

namespace {

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_ref(const at::Tensor& dy, const at::Tensor& pre,
                                                    c10::string_view act) {
  reference::check_epilogue_act("bias_act_bwd", act);
  auto dpre = activation_bwd(dy, pre, std::string(act));
  auto dbias = bias_bwd(dpre);
  return {std::move(dpre), std::move(dbias)};
}

at::Tensor bias_act_bwd__ref(const at::Tensor& dy, const at::Tensor& pre, c10::string_view act) {
  FUSIBLE_CHECK_SAME_DTYPE("bias_act_bwd_", "dy", dy, "pre", pre);
  auto [dpre, dbias] = bias_act_bwd_ref(dy, pre, act);
  dy.copy_(dpre);
  return dbias;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("linear_bias_act_fwd", &reference::linear_bias_act_fwd);
  m.impl("linear_bias_act", &reference::linear_bias_act);
  m.impl("linear_add", &reference::linear_add);
  m.impl("linear_add_", &reference::linear_add_);
  m.impl("linear_dgrad_add", &reference::linear_dgrad_add);
  m.impl("linear_dgrad_act_bias", &reference::linear_dgrad_act_bias);
  m.impl("bias_act_bwd", &bias_act_bwd_ref);
  m.impl("bias_act_bwd_", &bias_act_bwd__ref);
  m.impl("rmsnorm_bwd_add", &reference::rmsnorm_bwd_add);
  m.impl("layernorm_bwd_add", &reference::layernorm_bwd_add);
}

}  // namespace fusible::kernels

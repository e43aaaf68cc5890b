// The ops behind the fused ops (GEMMs with epilogues, bias + activation backward, norm backward
// with the residual gradient): their reference implementation composes the basic kernel ops in the
// accumulation dtype and rounds each result once, as the fused CUDA kernels do; it runs on CPU,
// CUDA and Meta. CUDA gets its own kernels (cuBLASLt epilogues) registered under the CUDA key.
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/linear/linear.h"
#include "kernels/norm/norm.h"
#include "kernels/dispatch.h"

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

// The fused references compute in the accumulation dtype (kernels/compute_dtype.h: fp32 for fp16
// and bf16, as the CUDA epilogues accumulate) and round each result once, at the end: the CPU
// path is the reference, so it must be at least as exact as the fused CUDA kernels. The basic
// references they compose return the accumulation dtype for inputs in it.
std::optional<at::Tensor> upcast(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(kernels::upcast(*t)) : std::nullopt;
}

// alpha * x W^T + bias (+ other), in the accumulation dtype; x, weight and bias checked by the
// caller, other against x's dtype here.
at::Tensor scaled_linear_acc(const char* op, const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, double alpha,
                             const at::Tensor& other = {}) {
  check_fwd_args(op, x, weight, bias);
  auto y = linear_fwd(kernels::upcast(x), kernels::upcast(weight),
                      alpha == 1.0 ? upcast(bias) : std::nullopt);
  if (alpha != 1.0) {
    y.mul_(alpha);
    if (bias) y.add_(kernels::upcast(*bias));
  }
  if (other.defined()) {
    FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "other", other);
    const auto other_acc = kernels::upcast(other);
    check_other(op, "other", other_acc, y);
    y.add_(other_acc);
  }
  return y;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_bias_act_fwd(const at::Tensor& x,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view act) {
  check_epilogue_act("linear_bias_act_fwd", act);
  const auto pre = scaled_linear_acc("linear_bias_act_fwd", x, weight, bias, 1.0);
  auto y = activation_fwd(pre, std::string(act));
  return {y.to(x.scalar_type()), pre.to(x.scalar_type())};
}

at::Tensor linear_bias_act(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view act) {
  check_epilogue_act("linear_bias_act", act);
  const auto pre = scaled_linear_acc("linear_bias_act", x, weight, bias, 1.0);
  return activation_fwd(pre, std::string(act)).to(x.scalar_type());
}

at::Tensor linear_add(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& other,
                      double alpha) {
  return scaled_linear_acc("linear_add", x, weight, bias, alpha, other).to(x.scalar_type());
}

void linear_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, double alpha) {
  out.copy_(scaled_linear_acc("linear_add_", x, weight, bias, alpha, out));
}

at::Tensor linear_dgrad_add(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& other,
                            double alpha) {
  check_linear_args("linear_dgrad_add", "dy", dy, weight, weight.size(0),
                    "weight.size(0), out_features");
  FUSIBLE_CHECK_SAME_DTYPE("linear_dgrad_add", "dy", dy, "other", other);
  auto dx = linear_dgrad(kernels::upcast(dy), kernels::upcast(weight), alpha);
  const auto other_acc = kernels::upcast(other);
  check_other("linear_dgrad_add", "other", other_acc, dx);
  return dx.add_(other_acc).to(dy.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> linear_dgrad_act_bias(const at::Tensor& dy,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& pre,
                                                         c10::string_view act) {
  check_epilogue_act("linear_dgrad_act_bias", act);
  check_linear_args("linear_dgrad_act_bias", "dy", dy, weight, weight.size(0),
                    "weight.size(0), out_features");
  FUSIBLE_CHECK_SAME_DTYPE("linear_dgrad_act_bias", "dy", dy, "pre", pre);
  const auto dz = linear_dgrad(kernels::upcast(dy), kernels::upcast(weight), 1.0);
  auto [dpre, dbias] = kernels::bias_act_bwd(dz, kernels::upcast(pre), std::string(act));
  return {dpre.to(dy.scalar_type()), dbias.to(dy.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_bwd_add(const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& rstd, const at::Tensor& weight,
                                                   bool zero_centered_gamma,
                                                   const at::Tensor& dextra) {
  FUSIBLE_CHECK_SAME_DTYPE("rmsnorm_bwd_add", "dy", dy, "dextra", dextra);
  auto [dx, dw] = kernels::rmsnorm_bwd(kernels::upcast(dy), kernels::upcast(x), rstd,
                                       kernels::upcast(weight), zero_centered_gamma);
  // add_fwd checks the shape; one rounding of dx + dextra.
  return {kernels::add_fwd(dx, kernels::upcast(dextra)).to(x.scalar_type()),
          dw.to(weight.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_bwd_add(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
    const at::Tensor& weight, bool zero_centered_gamma, const at::Tensor& dextra) {
  FUSIBLE_CHECK_SAME_DTYPE("layernorm_bwd_add", "dy", dy, "dextra", dextra);
  auto [dx, dw, db] = kernels::layernorm_bwd(kernels::upcast(dy), kernels::upcast(x), mean, rstd,
                                             kernels::upcast(weight), zero_centered_gamma);
  return {kernels::add_fwd(dx, kernels::upcast(dextra)).to(x.scalar_type()),
          dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

}  // namespace reference

namespace {

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_ref(const at::Tensor& dy, const at::Tensor& pre,
                                                    c10::string_view act) {
  reference::check_epilogue_act("bias_act_bwd", act);
  FUSIBLE_CHECK_SAME_DTYPE("bias_act_bwd", "dy", dy, "pre", pre);
  // dbias sums the unrounded dpre, as the CUDA kernel does.
  const auto dpre = activation_bwd(upcast(dy), upcast(pre), std::string(act));
  return {dpre.to(dy.scalar_type()), bias_bwd(dpre).to(dy.scalar_type())};
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

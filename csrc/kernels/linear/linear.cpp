// The linear family's checks and ATen references: linear_fwd / linear_dgrad / linear_wgrad (the
// GEMMs of BasicLinear; CPU, the CUDA fallback, Meta via ATen's meta kernels) and the GEMMs with
// fused epilogues, which compose the basic ops in the accumulation dtype and round each result
// once, as the fused CUDA kernels do. CUDA: linear_cuda.cpp (cuBLASLt epilogues).
#include "kernels/linear/linear.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/dispatch.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

void check_linear_args(const char* op, const char* x_name, const at::Tensor& x,
                       const at::Tensor& weight, int64_t x_dim_size, const char* expect) {
  FUSIBLE_CHECK_FLOATING(op, x_name, x);
  FUSIBLE_CHECK_MIN_DIM(op, x_name, x, 1);
  FUSIBLE_CHECK_DIM(op, "weight", weight, 2);
  FUSIBLE_CHECK_SAME_DEVICE(op, x_name, x, "weight", weight);
  FUSIBLE_CHECK_SAME_DTYPE(op, x_name, x, "weight", weight);
  TORCH_CHECK(x.size(-1) == x_dim_size, op, ": expected ", x_name, ".size(-1) == ", x_dim_size,
              " (", expect, "), got ", x.size(-1), " (", x_name, " shape ", shape_str(x),
              ", weight shape ", shape_str(weight), ")");
}

void check_wgrad_args(const at::Tensor& dy, const at::Tensor& x, const char* op) {
  FUSIBLE_CHECK_FLOATING(op, "dy", dy);
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_MIN_DIM(op, "dy", dy, 1);
  FUSIBLE_CHECK_MIN_DIM(op, "x", x, 1);
  FUSIBLE_CHECK_SAME_DTYPE(op, "dy", dy, "x", x);
  FUSIBLE_CHECK_SAME_DEVICE(op, "dy", dy, "x", x);
  const auto rows = [](const at::Tensor& t) { return t.reshape({-1, t.size(-1)}).sym_size(0); };
  TORCH_CHECK(rows(dy) == rows(x), op, ": expected dy and x with the same number of rows, ",
              "got shapes ", dy.sym_sizes(), " and ", x.sym_sizes());
}

void check_wgrad_add_args(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x) {
  constexpr const char* op = "linear_wgrad_add_";
  check_wgrad_args(dy, x, op);
  FUSIBLE_CHECK_FLOATING(op, "out", out);
  FUSIBLE_CHECK_SAME_DEVICE(op, "dy", dy, "out", out);
  const c10::SymInt want[] = {dy.sym_size(-1), x.sym_size(-1)};
  TORCH_CHECK(out.sym_sizes().equals(want), op, ": expected out of shape [", want[0], ", ", want[1],
              "] (dy's features, x's features), got ", out.sym_sizes());
}

void check_fwd_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias) {
  check_linear_args(op, "x", x, weight, weight.size(1), "weight.size(1), in_features");
  if (bias.has_value()) {
    FUSIBLE_CHECK_DIM(op, "bias", *bias, 1);
    FUSIBLE_CHECK_SIZE(op, "bias.size(0)", bias->size(0), weight.size(0));
    FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "bias", *bias);
    FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "bias", *bias);
  }
}

at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  check_fwd_args("linear_fwd", x, weight, bias);
  return at::linear(x, weight, bias).contiguous();
}

at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha) {
  check_linear_args("linear_dgrad", "dy", dy, weight, weight.size(0),
                    "weight.size(0), out_features");
  if (alpha == 1.0) return at::matmul(dy, weight).contiguous();
  // Scaled in the accumulation dtype: one rounding, as the CUDA epilogue's.
  return at::matmul(upcast(dy), upcast(weight)).mul_(alpha).to(dy.scalar_type()).contiguous();
}

at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha) {
  check_wgrad_args(dy, x);
  const auto dy2 = dy.reshape({-1, dy.size(-1)});
  const auto x2 = x.reshape({-1, x.size(-1)});
  if (alpha == 1.0) return at::mm(dy2.t(), x2);
  return at::mm(upcast(dy2).t(), upcast(x2)).mul_(alpha).to(dy.scalar_type());
}

void linear_wgrad_add_(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x,
                       double alpha, double beta) {
  check_wgrad_add_args(out, dy, x);
  // The product in out's precision or wider (fp32 for 16-bit inputs), added to out once.
  const auto acc = at::promote_types(out.scalar_type(), acc_dtype(dy.scalar_type()));
  const auto dy2 = dy.reshape({-1, dy.size(-1)}).to(acc);
  const auto x2 = x.reshape({-1, x.size(-1)}).to(acc);
  // beta = 0 ignores out's values (NaN included), as the GEMM's does.
  if (out.scalar_type() == acc) {
    out.addmm_(dy2.t(), x2, beta, alpha);
  } else {
    out.copy_(at::addmm(out.to(acc), dy2.t(), x2, beta, alpha));
  }
}

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

// The fused references compute in the accumulation dtype (kernels/common/compute_dtype.h: fp32 for
// fp16 and bf16, as the CUDA epilogues accumulate) and round each result once, at the end: the CPU
// path is the reference, so it must be at least as exact as the fused CUDA kernels. The basic
// references they compose return the accumulation dtype for inputs in it.
std::optional<at::Tensor> upcast_optional(const std::optional<at::Tensor>& t) {
  return t ? std::optional<at::Tensor>(kernels::upcast(*t)) : std::nullopt;
}

// alpha * x W^T + bias (+ other), in the accumulation dtype; x, weight and bias checked by the
// caller, other against x's dtype here.
at::Tensor scaled_linear_acc(const char* op, const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, double alpha,
                             const at::Tensor& other = {}) {
  check_fwd_args(op, x, weight, bias);
  auto y = linear_fwd(kernels::upcast(x), kernels::upcast(weight),
                      alpha == 1.0 ? upcast_optional(bias) : std::nullopt);
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

}  // namespace reference

// ---- Entry points for C++ callers (declared in linear.h).

at::Tensor linear_fwd(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  FUSIBLE_DISPATCH(linear_fwd, x, weight, bias);
}
at::Tensor linear_dgrad(const at::Tensor& dy, const at::Tensor& weight, double alpha) {
  FUSIBLE_DISPATCH(linear_dgrad, dy, weight, alpha);
}
at::Tensor linear_wgrad(const at::Tensor& dy, const at::Tensor& x, double alpha) {
  FUSIBLE_DISPATCH(linear_wgrad, dy, x, alpha);
}
std::tuple<at::Tensor, at::Tensor> linear_bias_act_fwd(const at::Tensor& x,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       const std::string& act) {
  FUSIBLE_DISPATCH(linear_bias_act_fwd, x, weight, bias, act);
}
at::Tensor linear_bias_act(const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, const std::string& act) {
  FUSIBLE_DISPATCH(linear_bias_act, x, weight, bias, act);
}
at::Tensor linear_add(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, const at::Tensor& other,
                      double alpha) {
  FUSIBLE_DISPATCH(linear_add, x, weight, bias, other, alpha);
}
void linear_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias, double alpha) {
  FUSIBLE_DISPATCH(linear_add_, out, x, weight, bias, alpha);
}
void linear_wgrad_add_(const at::Tensor& out, const at::Tensor& dy, const at::Tensor& x,
                       double alpha, double beta) {
  FUSIBLE_DISPATCH(linear_wgrad_add_, out, dy, x, alpha, beta);
}
at::Tensor linear_dgrad_add(const at::Tensor& dy, const at::Tensor& weight, const at::Tensor& other,
                            double alpha) {
  FUSIBLE_DISPATCH(linear_dgrad_add, dy, weight, other, alpha);
}
std::tuple<at::Tensor, at::Tensor> linear_dgrad_act_bias(const at::Tensor& dy,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& pre,
                                                         const std::string& act) {
  FUSIBLE_DISPATCH(linear_dgrad_act_bias, dy, weight, pre, act);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // y = x W^T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N].
  define(m, "linear_fwd(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // dx = alpha * dy W. dy: [..., N], weight: [N, K] -> [..., K].
  define(m, "linear_dgrad(Tensor dy, Tensor weight, float alpha=1.0) -> Tensor");
  // dW = alpha * dy^T x over all leading dims. dy: [..., N], x: [..., K] -> [N, K].
  define(m, "linear_wgrad(Tensor dy, Tensor x, float alpha=1.0) -> Tensor");
  // out = alpha * dy^T x + beta * out, in place, the product accumulated in out's precision (fp32
  // for 16-bit dy and x into an fp32 out: a weight gradient added into its fp32 main_grad). beta
  // = 0 ignores out's values. dy: [..., N], x: [..., K], out: [N, K].
  define(m,
         "linear_wgrad_add_(Tensor(a!) out, Tensor dy, Tensor x, float alpha=1.0, float "
         "beta=1.0) -> ()");
  // GEMMs with fused epilogues (ForwardLinear*/BackwardLinear* fused ops):
  // (y, pre) with pre = x W^T + bias and y = act(pre); act in {gelu (tanh), relu}.
  define(m,
         "linear_bias_act_fwd(Tensor x, Tensor weight, Tensor? bias, str act) -> (Tensor, Tensor)");
  // relu(x W^T + bias) (ReLU's backward reads its output, so no pre-activation is kept).
  define(m, "linear_bias_act(Tensor x, Tensor weight, Tensor? bias, str act) -> Tensor");
  // alpha * x W^T + bias + other, into a new tensor (other: the output's shape and dtype).
  define(m,
         "linear_add(Tensor x, Tensor weight, Tensor? bias, Tensor other, float alpha) -> Tensor");
  // out += alpha * x W^T + bias, in place.
  define(m,
         "linear_add_(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, float alpha) -> ()");
  // alpha * dy W + other, into a new tensor (other: dx's shape and dtype).
  define(m, "linear_dgrad_add(Tensor dy, Tensor weight, Tensor other, float alpha) -> Tensor");
  // The dgrad of the linear after a bias + activation, with the activation's backward and the
  // bias gradient in its epilogue: dz = dy W, -> (dpre = act'(pre) * dz, dbias = sum of dpre).
  define(
      m,
      "linear_dgrad_act_bias(Tensor dy, Tensor weight, Tensor pre, str act) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("linear_fwd", &reference::linear_fwd);
  m.impl("linear_dgrad", &reference::linear_dgrad);
  m.impl("linear_wgrad", &reference::linear_wgrad);
  m.impl("linear_wgrad_add_", &reference::linear_wgrad_add_);
  m.impl("linear_bias_act_fwd", &reference::linear_bias_act_fwd);
  m.impl("linear_bias_act", &reference::linear_bias_act);
  m.impl("linear_add", &reference::linear_add);
  m.impl("linear_add_", &reference::linear_add_);
  m.impl("linear_dgrad_add", &reference::linear_dgrad_add);
  m.impl("linear_dgrad_act_bias", &reference::linear_dgrad_act_bias);
}

}  // namespace fusible::kernels

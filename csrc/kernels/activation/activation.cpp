// Elementwise activations and gated (GLU-family) activations, forward and backward, through ATen in
// fp32 (fp64 for fp64). Gated ops split the last dim into halves (a, b) and compute act(a) * b.
#include "kernels/activation/activation.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/tanh.h>
#include <torch/library.h>

#include <cmath>
#include <string_view>

#include "common/checks.h"
#include "kernels/activation/activation_launchers.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

ActKind parse_activation(const char* op, std::string_view kind) {
  if (kind == "gelu") return ActKind::kGelu;
  if (kind == "qgelu") return ActKind::kQGelu;
  if (kind == "relu") return ActKind::kRelu;
  if (kind == "srelu") return ActKind::kSRelu;
  if (kind == "silu") return ActKind::kSilu;
  TORCH_CHECK_VALUE(false, op, ": expected kind in {gelu, qgelu, relu, srelu, silu}, got '", kind,
                    "'");
}

// Gated kinds name the activation applied to the first half.
ActKind parse_gated(const char* op, std::string_view kind) {
  if (kind == "glu") return ActKind::kSigmoid;
  if (kind == "geglu") return ActKind::kGelu;
  if (kind == "qgeglu") return ActKind::kQGelu;
  if (kind == "reglu") return ActKind::kRelu;
  if (kind == "sreglu") return ActKind::kSRelu;
  if (kind == "swiglu") return ActKind::kSilu;
  TORCH_CHECK_VALUE(false, op,
                    ": expected kind in {glu, geglu, qgeglu, reglu, sreglu, swiglu}, got '", kind,
                    "'");
}

void check_glu_input(const char* op, const at::Tensor& x) {
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_MIN_DIM(op, "x", x, 1);
  TORCH_CHECK(x.size(-1) % 2 == 0, op, ": expected x.size(-1) to be even, got ", x.size(-1),
              " (x shape ", shape_str(x), ")");
}

void check_glu_grad(const char* op, const at::Tensor& dy, const at::Tensor& x) {
  FUSIBLE_CHECK_SAME_DEVICE(op, "dy", dy, "x", x);
  auto expected = x.sizes().vec();
  expected.back() /= 2;
  TORCH_CHECK(dy.sizes().equals(expected), op, ": expected dy of shape ", at::IntArrayRef(expected),
              ", got ", dy.sizes());
}

void check_clamped_params(const char* op, double limit, double alpha, double offset) {
  TORCH_CHECK_VALUE(std::isfinite(limit) && limit >= 0, op, ": expected a finite limit >= 0, got ",
                    limit);
  TORCH_CHECK_VALUE(std::isfinite(alpha) && std::isfinite(offset), op,
                    ": expected finite alpha and offset, got alpha=", alpha, ", offset=", offset);
}

void check_situ_params(const char* op, double beta1, double beta2) {
  TORCH_CHECK_VALUE(std::isfinite(beta1) && beta1 > 0 && std::isfinite(beta2) && beta2 > 0, op,
                    ": expected finite beta1 > 0 and beta2 > 0, got beta1=", beta1,
                    ", beta2=", beta2);
}

void check_scales(const char* op, const at::Tensor& x, const at::Tensor& scales) {
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "scales", scales);
  FUSIBLE_CHECK_FLOATING(op, "scales", scales);
  TORCH_CHECK(x.dim() >= 1 && scales.sizes().equals(x.sizes().slice(0, x.dim() - 1)), op,
              ": expected scales of shape ", x.sizes().slice(0, std::max<int64_t>(x.dim() - 1, 0)),
              " (x's shape without the last dim), got ", scales.sizes());
}

}  // namespace reference

// The implementations registered under CompositeExplicitAutograd (named: the entry points
// below have the same names).
namespace composite {

using Act = ActKind;
using reference::check_glu_grad;
using reference::check_scales;
using reference::parse_activation;
using reference::parse_gated;

// act(x) for x in the accumulation dtype.
at::Tensor act_value(Act act, const at::Tensor& x) {
  switch (act) {
    case Act::kGelu:
      return 0.5 * x * (1 + at::tanh(kGeluC * (x + kGeluA * x * x * x)));
    case Act::kQGelu:
      return x * at::sigmoid(kQGeluAlpha * x);
    case Act::kRelu:
      return x.clamp_min(0);
    case Act::kSRelu:
      return x.clamp_min(0).pow(2);
    case Act::kSilu:
      return x * at::sigmoid(x);
    case Act::kSigmoid:
      return at::sigmoid(x);
  }
  TORCH_INTERNAL_ASSERT(false);
}

// d act(x) / dx for x in the accumulation dtype.
at::Tensor act_derivative(Act act, const at::Tensor& x) {
  switch (act) {
    case Act::kGelu: {
      const auto t = at::tanh(kGeluC * (x + kGeluA * x * x * x));
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kGeluC * (1 + 3 * kGeluA * x * x);
    }
    case Act::kQGelu: {
      const auto s = at::sigmoid(kQGeluAlpha * x);
      return s + kQGeluAlpha * x * s * (1 - s);
    }
    case Act::kRelu:
      return (x > 0).to(x.scalar_type());
    case Act::kSRelu:
      return 2 * x.clamp_min(0);
    case Act::kSilu: {
      const auto s = at::sigmoid(x);
      return s * (1 + x * (1 - s));
    }
    case Act::kSigmoid: {
      const auto s = at::sigmoid(x);
      return s * (1 - s);
    }
  }
  TORCH_INTERNAL_ASSERT(false);
}

// Halves (a, b) of x's last dim, in the accumulation dtype.
std::pair<at::Tensor, at::Tensor> split_halves(const char* op, const at::Tensor& x) {
  reference::check_glu_input(op, x);
  const auto xf = upcast(x);
  const auto h = x.size(-1) / 2;
  return {xf.narrow(-1, 0, h), xf.narrow(-1, h, h)};
}

at::Tensor activation_fwd(const at::Tensor& x, c10::string_view kind) {
  FUSIBLE_CHECK_FLOATING("activation_fwd", "x", x);
  const auto act = parse_activation("activation_fwd", kind);
  return act_value(act, upcast(x)).to(x.scalar_type());
}

at::Tensor activation_bwd(const at::Tensor& dy, const at::Tensor& x, c10::string_view kind) {
  FUSIBLE_CHECK_SAME_DEVICE("activation_bwd", "dy", dy, "x", x);
  FUSIBLE_CHECK_FLOATING("activation_bwd", "x", x);
  TORCH_CHECK(dy.sizes().equals(x.sizes()), "activation_bwd: expected dy of shape ", x.sizes(),
              ", got ", dy.sizes());
  const auto act = parse_activation("activation_bwd", kind);
  return (upcast(dy) * act_derivative(act, upcast(x))).to(x.scalar_type());
}

at::Tensor glu_fwd(const at::Tensor& x, c10::string_view kind) {
  const auto act = parse_gated("glu_fwd", kind);
  const auto [a, b] = split_halves("glu_fwd", x);
  return (act_value(act, a) * b).to(x.scalar_type());
}

at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, c10::string_view kind) {
  const auto act = parse_gated("glu_bwd", kind);
  const auto [a, b] = split_halves("glu_bwd", x);
  const auto dyf = upcast(dy);
  check_glu_grad("glu_bwd", dy, x);
  return at::cat({dyf * b * act_derivative(act, a), dyf * act_value(act, a)}, -1)
      .to(x.scalar_type());
}

// One gated pair's value and partial derivatives, on the halves in the accumulation dtype.
struct GateTerms {
  at::Tensor value, da, db;
};

// ClampedSwiGLU (GPT-OSS): a <- min(a, limit), b <- clamp(b, -limit, limit),
// y = a * sigmoid(alpha * a) * (b + offset). Clamped elements pass no gradient.
GateTerms clamped_terms(const at::Tensor& a, const at::Tensor& b, double limit, double alpha,
                        double offset) {
  const auto ac = a.clamp_max(limit);
  const auto bc = b.clamp(-limit, limit) + offset;
  const auto s = at::sigmoid(alpha * ac);
  return {ac * s * bc, bc * (s + alpha * ac * s * (1 - s)) * (a <= limit),
          ac * s * ((b >= -limit) & (b <= limit))};
}

// SiTUGLU: gate(a) = beta1 tanh(a / beta1) sigmoid(a), up(b) = beta2 tanh(b / beta2).
GateTerms situ_terms(const at::Tensor& a, const at::Tensor& b, double beta1, double beta2) {
  const auto ta = at::tanh(a / beta1), tb = at::tanh(b / beta2), s = at::sigmoid(a);
  const auto gate = beta1 * ta * s, up = beta2 * tb;
  return {gate * up, up * ((1 - ta * ta) * s + beta1 * ta * s * (1 - s)), gate * (1 - tb * tb)};
}

GateTerms swiglu_terms(const at::Tensor& a, const at::Tensor& b) {
  const auto act = act_value(Act::kSilu, a);
  return {act * b, b * act_derivative(Act::kSilu, a), act};
}

at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha, double offset) {
  reference::check_clamped_params("clamped_swiglu_fwd", limit, alpha, offset);
  const auto [a, b] = split_halves("clamped_swiglu_fwd", x);
  return clamped_terms(a, b, limit, alpha, offset).value.to(x.scalar_type());
}

at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit, double alpha,
                              double offset) {
  reference::check_clamped_params("clamped_swiglu_bwd", limit, alpha, offset);
  const auto [a, b] = split_halves("clamped_swiglu_bwd", x);
  check_glu_grad("clamped_swiglu_bwd", dy, x);
  const auto t = clamped_terms(a, b, limit, alpha, offset);
  const auto dyf = upcast(dy);
  return at::cat({dyf * t.da, dyf * t.db}, -1).to(x.scalar_type());
}

at::Tensor situglu_fwd(const at::Tensor& x, double beta1, double beta2) {
  reference::check_situ_params("situglu_fwd", beta1, beta2);
  const auto [a, b] = split_halves("situglu_fwd", x);
  return situ_terms(a, b, beta1, beta2).value.to(x.scalar_type());
}

at::Tensor situglu_bwd(const at::Tensor& dy, const at::Tensor& x, double beta1, double beta2) {
  reference::check_situ_params("situglu_bwd", beta1, beta2);
  const auto [a, b] = split_halves("situglu_bwd", x);
  check_glu_grad("situglu_bwd", dy, x);
  const auto t = situ_terms(a, b, beta1, beta2);
  const auto dyf = upcast(dy);
  return at::cat({dyf * t.da, dyf * t.db}, -1).to(x.scalar_type());
}

// y = scales[..., None] * gate(x) for the gate `terms` computes from x's halves.
template <typename Terms>
at::Tensor scaled_fwd(const char* op, const at::Tensor& x, const at::Tensor& scales,
                      Terms&& terms) {
  check_scales(op, x, scales);
  const auto [a, b] = split_halves(op, x);
  return (upcast(scales).unsqueeze(-1) * terms(a, b).value).to(x.scalar_type());
}

// -> (dx, dscales = sum over the last dim of dy * gate(x)).
template <typename Terms>
std::tuple<at::Tensor, at::Tensor> scaled_bwd(const char* op, const at::Tensor& dy,
                                              const at::Tensor& x, const at::Tensor& scales,
                                              Terms&& terms) {
  check_scales(op, x, scales);
  const auto [a, b] = split_halves(op, x);
  check_glu_grad(op, dy, x);
  const auto dyf = upcast(dy);
  const auto dys = dyf * upcast(scales).unsqueeze(-1);
  const auto t = terms(a, b);
  const auto dx = at::cat({dys * t.da, dys * t.db}, -1);
  return {dx.to(x.scalar_type()), (dyf * t.value).sum(-1).to(scales.scalar_type())};
}

at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales) {
  return scaled_fwd("scaled_swiglu_fwd", x, scales, swiglu_terms);
}

std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales) {
  return scaled_bwd("scaled_swiglu_bwd", dy, x, scales, swiglu_terms);
}

// scaled_swiglu_bwd and the forward's y from the same terms.
std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_swiglu_bwd_fwd(const at::Tensor& dy,
                                                                     const at::Tensor& x,
                                                                     const at::Tensor& scales) {
  auto [dx, dscales] = scaled_bwd("scaled_swiglu_bwd_fwd", dy, x, scales, swiglu_terms);
  return {dx, dscales, scaled_fwd("scaled_swiglu_bwd_fwd", x, scales, swiglu_terms)};
}

at::Tensor scaled_situglu_fwd(const at::Tensor& x, const at::Tensor& scales, double beta1,
                              double beta2) {
  reference::check_situ_params("scaled_situglu_fwd", beta1, beta2);
  return scaled_fwd("scaled_situglu_fwd", x, scales,
                    [&](const auto& a, const auto& b) { return situ_terms(a, b, beta1, beta2); });
}

std::tuple<at::Tensor, at::Tensor> scaled_situglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                      const at::Tensor& scales, double beta1,
                                                      double beta2) {
  reference::check_situ_params("scaled_situglu_bwd", beta1, beta2);
  return scaled_bwd("scaled_situglu_bwd", dy, x, scales,
                    [&](const auto& a, const auto& b) { return situ_terms(a, b, beta1, beta2); });
}

at::Tensor scaled_clamped_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales, double limit,
                                     double alpha, double offset) {
  reference::check_clamped_params("scaled_clamped_swiglu_fwd", limit, alpha, offset);
  return scaled_fwd("scaled_clamped_swiglu_fwd", x, scales, [&](const auto& a, const auto& b) {
    return clamped_terms(a, b, limit, alpha, offset);
  });
}

std::tuple<at::Tensor, at::Tensor> scaled_clamped_swiglu_bwd(const at::Tensor& dy,
                                                             const at::Tensor& x,
                                                             const at::Tensor& scales, double limit,
                                                             double alpha, double offset) {
  reference::check_clamped_params("scaled_clamped_swiglu_bwd", limit, alpha, offset);
  return scaled_bwd("scaled_clamped_swiglu_bwd", dy, x, scales, [&](const auto& a, const auto& b) {
    return clamped_terms(a, b, limit, alpha, offset);
  });
}

}  // namespace composite

// ---- Entry points for C++ callers (declared in activation.h).

at::Tensor activation_fwd(const at::Tensor& x, const std::string& kind) {
  FUSIBLE_DISPATCH(activation_fwd, x, kind);
}
at::Tensor activation_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind) {
  FUSIBLE_DISPATCH(activation_bwd, dy, x, kind);
}
at::Tensor glu_fwd(const at::Tensor& x, const std::string& kind) {
  FUSIBLE_DISPATCH(glu_fwd, x, kind);
}
at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind) {
  FUSIBLE_DISPATCH(glu_bwd, dy, x, kind);
}
at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha, double offset) {
  FUSIBLE_DISPATCH(clamped_swiglu_fwd, x, limit, alpha, offset);
}
at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit, double alpha,
                              double offset) {
  FUSIBLE_DISPATCH(clamped_swiglu_bwd, dy, x, limit, alpha, offset);
}
at::Tensor situglu_fwd(const at::Tensor& x, double beta1, double beta2) {
  FUSIBLE_DISPATCH(situglu_fwd, x, beta1, beta2);
}
at::Tensor situglu_bwd(const at::Tensor& dy, const at::Tensor& x, double beta1, double beta2) {
  FUSIBLE_DISPATCH(situglu_bwd, dy, x, beta1, beta2);
}
at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales) {
  FUSIBLE_DISPATCH(scaled_swiglu_fwd, x, scales);
}
std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales) {
  FUSIBLE_DISPATCH(scaled_swiglu_bwd, dy, x, scales);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_swiglu_bwd_fwd(const at::Tensor& dy,
                                                                     const at::Tensor& x,
                                                                     const at::Tensor& scales) {
  FUSIBLE_DISPATCH(scaled_swiglu_bwd_fwd, dy, x, scales);
}
at::Tensor scaled_situglu_fwd(const at::Tensor& x, const at::Tensor& scales, double beta1,
                              double beta2) {
  FUSIBLE_DISPATCH(scaled_situglu_fwd, x, scales, beta1, beta2);
}
std::tuple<at::Tensor, at::Tensor> scaled_situglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                      const at::Tensor& scales, double beta1,
                                                      double beta2) {
  FUSIBLE_DISPATCH(scaled_situglu_bwd, dy, x, scales, beta1, beta2);
}
at::Tensor scaled_clamped_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales, double limit,
                                     double alpha, double offset) {
  FUSIBLE_DISPATCH(scaled_clamped_swiglu_fwd, x, scales, limit, alpha, offset);
}
std::tuple<at::Tensor, at::Tensor> scaled_clamped_swiglu_bwd(const at::Tensor& dy,
                                                             const at::Tensor& x,
                                                             const at::Tensor& scales, double limit,
                                                             double alpha, double offset) {
  FUSIBLE_DISPATCH(scaled_clamped_swiglu_bwd, dy, x, scales, limit, alpha, offset);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // Elementwise activation; kind in {gelu (tanh), qgelu, relu, srelu, silu}.
  define(m, "activation_fwd(Tensor x, str kind) -> Tensor");
  // Its backward: dx = dy * act'(x).
  define(m, "activation_bwd(Tensor dy, Tensor x, str kind) -> Tensor");
  // Gated activation: x = [a, b] on the last dim, y = act(a) * b; kind in {glu, geglu, qgeglu,
  // reglu, sreglu, swiglu}. x: [..., 2H] -> [..., H].
  define(m, "glu_fwd(Tensor x, str kind) -> Tensor");
  // Its backward -> dx [..., 2H].
  define(m, "glu_bwd(Tensor dy, Tensor x, str kind) -> Tensor");
  // ClampedSwiGLU: a = min(a, limit), b = clamp(b, -limit, limit),
  // y = a * sigmoid(alpha * a) * (b + offset).
  define(m, "clamped_swiglu_fwd(Tensor x, float limit, float alpha, float offset=1.0) -> Tensor");
  // Its backward -> dx.
  define(m,
         "clamped_swiglu_bwd(Tensor dy, Tensor x, float limit, float alpha, float offset=1.0) -> "
         "Tensor");
  // SiTUGLU: y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) (beta1, beta2 > 0).
  define(m, "situglu_fwd(Tensor x, float beta1=4.0, float beta2=25.0) -> Tensor");
  // Its backward -> dx.
  define(m, "situglu_bwd(Tensor dy, Tensor x, float beta1=4.0, float beta2=25.0) -> Tensor");
  // ScaledSwiGLU: y = scales[..., None] * swiglu(x). scales: x's shape without the last dim.
  define(m, "scaled_swiglu_fwd(Tensor x, Tensor scales) -> Tensor");
  // Its backward -> (dx, dscales).
  define(m, "scaled_swiglu_bwd(Tensor dy, Tensor x, Tensor scales) -> (Tensor, Tensor)");
  // scaled_swiglu_bwd plus the forward's output y = scales * swiglu(x), recomputed in the same
  // pass (a fused op that keeps x need not keep y) -> (dx, dscales, y).
  define(m,
         "scaled_swiglu_bwd_fwd(Tensor dy, Tensor x, Tensor scales) -> (Tensor, Tensor, Tensor)");
  // ScaledSiTUGLU: y = scales[..., None] * situglu(x); backward -> (dx, dscales).
  define(
      m,
      "scaled_situglu_fwd(Tensor x, Tensor scales, float beta1=4.0, float beta2=25.0) -> Tensor");
  define(
      m,
      "scaled_situglu_bwd(Tensor dy, Tensor x, Tensor scales, float beta1=4.0, float beta2=25.0) "
      "-> (Tensor, Tensor)");
  // ScaledClampedQGeGLU: y = scales[..., None] * clamped_swiglu(x); backward -> (dx, dscales).
  define(m,
         "scaled_clamped_swiglu_fwd(Tensor x, Tensor scales, float limit=7.0, float alpha=1.702, "
         "float offset=1.0) -> Tensor");
  define(m,
         "scaled_clamped_swiglu_bwd(Tensor dy, Tensor x, Tensor scales, float limit=7.0, "
         "float alpha=1.702, float offset=1.0) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("activation_fwd", &composite::activation_fwd);
  m.impl("activation_bwd", &composite::activation_bwd);
  m.impl("glu_fwd", &composite::glu_fwd);
  m.impl("glu_bwd", &composite::glu_bwd);
  m.impl("clamped_swiglu_fwd", &composite::clamped_swiglu_fwd);
  m.impl("clamped_swiglu_bwd", &composite::clamped_swiglu_bwd);
  m.impl("scaled_swiglu_fwd", &composite::scaled_swiglu_fwd);
  m.impl("scaled_swiglu_bwd", &composite::scaled_swiglu_bwd);
  m.impl("scaled_swiglu_bwd_fwd", &composite::scaled_swiglu_bwd_fwd);
  m.impl("situglu_fwd", &composite::situglu_fwd);
  m.impl("situglu_bwd", &composite::situglu_bwd);
  m.impl("scaled_situglu_fwd", &composite::scaled_situglu_fwd);
  m.impl("scaled_situglu_bwd", &composite::scaled_situglu_bwd);
  m.impl("scaled_clamped_swiglu_fwd", &composite::scaled_clamped_swiglu_fwd);
  m.impl("scaled_clamped_swiglu_bwd", &composite::scaled_clamped_swiglu_bwd);
}

}  // namespace fusible::kernels

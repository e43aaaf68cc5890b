// Elementwise activations and gated (GLU-family) activations, forward and backward, through ATen in
// fp32 (fp64 for fp64). Gated ops split the last dim into halves (a, b) and compute act(a) * b.
#include "kernels/activations.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/tanh.h>
#include <torch/library.h>

#include <string_view>

#include "common/checks.h"
#include "kernels/compute_dtype.h"

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

void check_scales(const char* op, const at::Tensor& x, const at::Tensor& scales) {
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "scales", scales);
  FUSIBLE_CHECK_FLOATING(op, "scales", scales);
  TORCH_CHECK(x.dim() >= 1 && scales.sizes().equals(x.sizes().slice(0, x.dim() - 1)), op,
              ": expected scales of shape ", x.sizes().slice(0, std::max<int64_t>(x.dim() - 1, 0)),
              " (x's shape without the last dim), got ", scales.sizes());
}

}  // namespace reference

namespace {

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

// ClampedSwiGLU (GPT-OSS): a <- min(a, limit), b <- clamp(b, -limit, limit),
// y = a * sigmoid(alpha * a) * (b + 1). Clamped elements pass no gradient.
at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha) {
  const auto [a, b] = split_halves("clamped_swiglu_fwd", x);
  const auto ac = a.clamp_max(limit);
  return (ac * at::sigmoid(alpha * ac) * (b.clamp(-limit, limit) + 1)).to(x.scalar_type());
}

at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit,
                              double alpha) {
  const auto [a, b] = split_halves("clamped_swiglu_bwd", x);
  check_glu_grad("clamped_swiglu_bwd", dy, x);
  const auto dyf = upcast(dy);
  const auto ac = a.clamp_max(limit);
  const auto bc = b.clamp(-limit, limit);
  const auto s = at::sigmoid(alpha * ac);
  const auto da = dyf * (bc + 1) * (s + alpha * ac * s * (1 - s)) * (a <= limit);
  const auto db = dyf * ac * s * ((b >= -limit) & (b <= limit));
  return at::cat({da, db}, -1).to(x.scalar_type());
}

// y = scales[..., None] * swiglu(x).
at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales) {
  check_scales("scaled_swiglu_fwd", x, scales);
  const auto [a, b] = split_halves("scaled_swiglu_fwd", x);
  return (upcast(scales).unsqueeze(-1) * act_value(Act::kSilu, a) * b).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales) {
  check_scales("scaled_swiglu_bwd", x, scales);
  const auto [a, b] = split_halves("scaled_swiglu_bwd", x);
  check_glu_grad("scaled_swiglu_bwd", dy, x);
  const auto dyf = upcast(dy);
  const auto s = upcast(scales).unsqueeze(-1);
  const auto act = act_value(Act::kSilu, a);
  const auto dx = at::cat({dyf * s * b * act_derivative(Act::kSilu, a), dyf * s * act}, -1);
  const auto dscales = (dyf * act * b).sum(-1);
  return {dx.to(x.scalar_type()), dscales.to(scales.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("activation_fwd", &activation_fwd);
  m.impl("activation_bwd", &activation_bwd);
  m.impl("glu_fwd", &glu_fwd);
  m.impl("glu_bwd", &glu_bwd);
  m.impl("clamped_swiglu_fwd", &clamped_swiglu_fwd);
  m.impl("clamped_swiglu_bwd", &clamped_swiglu_bwd);
  m.impl("scaled_swiglu_fwd", &scaled_swiglu_fwd);
  m.impl("scaled_swiglu_bwd", &scaled_swiglu_bwd);
}

}  // namespace fusible::kernels

// The thread's FP8 autocast and the per-op casts.
#include "ops/quantization.h"

#include <c10/util/Exception.h>

#include "kernels/ops.h"

namespace fusible::ops {
namespace {

thread_local Fp8Autocast current;

void check(const Fp8Autocast& a) {
  if (!a.enabled) return;
  TORCH_CHECK_VALUE(a.recipe != nullptr, "fusible.autocast: enabled without a recipe");
  TORCH_CHECK_NOT_IMPLEMENTED(a.recipe->kind == "current", "fusible.autocast: recipe '",
                              a.recipe->kind,
                              "' is not supported yet; use recipe.Float8CurrentScaling");
  for (const auto* f : {&a.recipe->forward_format, &a.recipe->backward_format}) {
    TORCH_CHECK_VALUE(*f == "e4m3" || *f == "e5m2",
                      "fusible.autocast: expected FP8 formats 'e4m3' or 'e5m2', got '", *f, "'");
  }
}

}  // namespace

const Fp8Autocast& fp8_autocast() { return current; }

Fp8Autocast exchange_fp8_autocast(Fp8Autocast autocast) {
  check(autocast);
  std::swap(current, autocast);
  return autocast;
}

Fp8AutocastGuard::Fp8AutocastGuard(bool enabled, std::shared_ptr<const Fp8Recipe> recipe)
    : saved_(exchange_fp8_autocast({enabled, std::move(recipe)})) {}

Fp8AutocastGuard::~Fp8AutocastGuard() { current = std::move(saved_); }

at::Tensor Fp8Cast::forward(const at::Tensor& x) const {
  if (!on() || !x.defined()) return x;
  return kernels::fp8_quantize_dequantize(x, recipe->forward_format, recipe->margin);
}

at::Tensor Fp8Cast::backward(const at::Tensor& dy) const {
  if (!on() || !dy.defined()) return dy;
  return kernels::fp8_quantize_dequantize(dy, recipe->backward_format, recipe->margin);
}

Fp8Cast current_fp8_cast() {
  const auto& a = fp8_autocast();
  return Fp8Cast{a.enabled ? a.recipe : nullptr};
}

}  // namespace fusible::ops

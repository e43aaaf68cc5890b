// Parameter placement and input checks for ops that own parameters.
#include "ops/parameter_utils.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "common/checks.h"

namespace fusible::ops {

c10::TensorOptions param_options(std::optional<c10::Device> device,
                                 std::optional<at::ScalarType> dtype) {
  const auto dev = device.value_or(at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU));
  const auto dt = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(at::isFloatingType(dt), "expected a floating-point parameter dtype, got ", dt);
  return c10::TensorOptions().device(dev).dtype(dt);
}

void check_input_against_param(const char* op, const at::Tensor& x, const at::Tensor& param) {
  FUSIBLE_CHECK_FLOATING(op, "input", x);
  TORCH_CHECK(x.device() == param.device(), op, ": expected input on ", param.device(),
              " (the device of its parameters), got ", x.device());
}

void init_linear_weight_(at::Tensor& weight) {
  const at::NoGradGuard no_grad;
  const int64_t fan_in = weight.size(1);
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  weight.uniform_(-bound, bound);
}

}  // namespace fusible::ops

// Parameter placement and input checks for ops that own parameters.
#include "ops/parameter_utils.h"

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>

#include "common/checks.h"

namespace fusible::ops {

c10::TensorOptions param_options(std::optional<c10::Device> device,
                                 std::optional<at::ScalarType> dtype) {
  const auto dev =
      device.value_or(at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU));
  const auto dt = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(at::isFloatingType(dt), "expected a floating-point parameter dtype, got ", dt);
  return c10::TensorOptions().device(dev).dtype(dt);
}

void check_input_against_param(const char* op, const at::Tensor& x, const at::Tensor& param) {
  FUSIBLE_CHECK_FLOATING(op, "input", x);
  TORCH_CHECK(x.device() == param.device(), op, ": expected input on ", param.device(),
              " (the device of its parameters), got ", x.device());
}

void check_param_shape(const char* op, const char* name, const at::Tensor& param,
                       c10::IntArrayRef expected) {
  TORCH_CHECK(param.sizes().equals(expected), op, ": expected parameter '", name, "' of shape ",
              expected, ", got ", param.sizes());
}

c10::Device default_parameter_device() {
  return at::hasCUDA() ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
}

void assign_in_place_(const at::Tensor& param, const at::Tensor& value) {
  TORCH_CHECK(param.defined() && value.defined(), "assign_in_place_: expected defined tensors");
  if (param.unsafeGetTensorImpl() == value.unsafeGetTensorImpl()) return;
  TORCH_CHECK(!value.requires_grad() || value.is_leaf(),
              "assign_in_place_: expected a value that is not part of an autograd graph");
  if (auto* meta = torch::autograd::impl::get_autograd_meta(param)) {
    // An accumulator made for the old device/dtype would misroute gradients (as set_data does).
    meta->grad_accumulator_.reset();
    const auto& grad = param.grad();
    if (grad.defined() && (grad.device() != value.device() || grad.sizes() != value.sizes())) {
      param.mutable_grad() = at::Tensor();
    }
  }
  param.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
}

void materialize_(const at::Tensor& param, c10::Device device) {
  // A parameter first made real under torch.inference_mode() must still be trainable: allocate a
  // normal tensor, not an inference tensor.
  const c10::InferenceMode not_inference(false);
  assign_in_place_(param, at::empty(param.sizes(), param.options().device(device)));
}

void init_linear_weight_(const at::Tensor& weight) {
  const at::NoGradGuard no_grad;
  const int64_t fan_in = weight.size(1);
  const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
  weight.uniform_(-bound, bound);
}

}  // namespace fusible::ops

// Bias through fusible::bias_fwd / bias_bwd.
#include "ops/basic/bias.h"

#include <ATen/ops/empty.h>

#include "common/checks.h"
#include "kernels/dispatch.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {

Bias::Bias(int64_t size, std::optional<c10::Device> device, std::optional<at::ScalarType> dtype)
    : BasicOperation("Bias"), size_(size) {
  TORCH_CHECK_VALUE(size > 0, "Bias: expected size > 0, got ", size);
  const auto& b = register_parameter("bias", at::empty({size}, param_options(device, dtype)));
  if (!b.is_meta()) reset_parameters();
}

void Bias::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  const at::NoGradGuard no_grad;
  bias().zero_();
}

at::Tensor Bias::prepare_forward(OperationContext& ctx, const ForwardArgs& args) {
  const auto& bias = ctx.param(0, "Bias");
  check_param_shape("Bias", "bias", bias, {size_});
  ctx.compute_dtype = compute_dtype(args, bias.scalar_type());
  return cast_to(bias, ctx.compute_dtype);
}

at::Tensor Bias::op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs& args) {
  check_input_against_param("Bias", x, ctx.param(0, "Bias"));
  FUSIBLE_CHECK_MIN_DIM("Bias", "input", x, 1);
  TORCH_CHECK(x.size(-1) == size_, "Bias: expected input.size(-1) == ", size_, ", got ", x.size(-1),
              " (input shape ", shape_str(x), ")");
  const auto b = prepare_forward(ctx, args);
  return kernels::bias_fwd(cast_to(x, ctx.compute_dtype), b);
}

std::pair<at::Tensor, std::vector<at::Tensor>> Bias::op_backward(OperationContext& ctx,
                                                                 const at::Tensor& dy) {
  at::Tensor db;
  if (ctx.param_requires_grad.at(0)) db = kernels::bias_bwd(cast_to(dy, ctx.compute_dtype));
  return {dy, {db}};
}

}  // namespace fusible::ops

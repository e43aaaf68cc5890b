// BasicLinear through fusible::linear_fwd / linear_dgrad / linear_wgrad. Saves the input only when
// the weight needs a gradient and the weight only when the input does. Under an FP8 autocast its
// GEMMs take FP8-cast operands (ops/quantization.h).
#include "ops/basic/basic_linear.h"

#include <ATen/ops/empty.h>

#include "common/checks.h"
#include "kernels/ops.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {

BasicLinear::BasicLinear(int64_t in_features, int64_t out_features,
                         std::optional<c10::Device> device, std::optional<at::ScalarType> dtype)
    : BasicOperation("BasicLinear"), in_features_(in_features), out_features_(out_features) {
  TORCH_CHECK_VALUE(in_features > 0 && out_features > 0,
                    "BasicLinear: expected positive in_features and out_features, got ",
                    in_features, " and ", out_features);
  const auto& w = register_parameter(
      "weight", at::empty({out_features, in_features}, param_options(device, dtype)));
  if (!w.is_meta()) reset_parameters();
}

void BasicLinear::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  init_linear_weight_(weight());
}

std::pair<at::Tensor, at::Tensor> BasicLinear::prepare_forward(OperationContext& ctx,
                                                               const at::Tensor& x,
                                                               const ForwardArgs& args) {
  const auto& weight = ctx.param(0, "BasicLinear");
  check_param_shape("BasicLinear", "weight", weight, {out_features_, in_features_});
  check_input_against_param("BasicLinear", x, weight);
  FUSIBLE_CHECK_MIN_DIM("BasicLinear", "input", x, 1);
  TORCH_CHECK(x.size(-1) == in_features_, "BasicLinear: expected input.size(-1) == in_features (",
              in_features_, "), got ", x.size(-1), " (input shape ", shape_str(x), ")");
  ctx.compute_dtype = compute_dtype(args, weight.scalar_type());
  // Under an FP8 autocast the GEMMs see x and w cast to FP8 (and the backward, dy): fixed here, so
  // every fused forward and backward that goes through this op's forward and backward_gemms does.
  ctx.fp8 = fp8_cast(x);
  const auto x_hp = cast_to(x, ctx.compute_dtype);
  const auto xc = ctx.fp8.forward(x_hp, 0);
  const auto w = ctx.fp8.forward(cast_to(weight, ctx.compute_dtype), 1, /*weight=*/true);
  if (ctx.requires_grad) {
    // The wgrad GEMM's x: under block scaling cast along the tokens (column-wise), else xc.
    const bool need_x = ctx.param_requires_grad.at(0);
    const auto x_w = !need_x                      ? at::Tensor()
                     : ctx.fp8.needs_columnwise() ? ctx.fp8.columnwise(x_hp, /*backward=*/false)
                                                  : xc;
    ctx.save_for_backward({x_w, ctx.input_requires_grad ? w : at::Tensor()});
  }
  return {xc, w};
}

at::Tensor BasicLinear::op_forward(OperationContext& ctx, const at::Tensor& x,
                                   const ForwardArgs& args) {
  const auto [xc, w] = prepare_forward(ctx, x, args);
  return kernels::linear_fwd(xc, w, std::nullopt);
}

std::pair<at::Tensor, std::vector<at::Tensor>> BasicLinear::op_backward(OperationContext& ctx,
                                                                        const at::Tensor& dy) {
  // dw in the compute dtype: the fuser casts it to the weight's.
  auto [dx, dw] = backward_gemms(
      ctx, cast_to(dy, ctx.compute_dtype), 1.0,
      [](const at::Tensor& g, const at::Tensor& w) { return kernels::linear_dgrad(g, w); });
  return {dx, {dw}};
}

}  // namespace fusible::ops

// GroupedLinear through the linear kernels, one call per non-empty group.
#include "ops/basic/grouped_linear.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include "common/checks.h"
#include "kernels/ops.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {

GroupedLinear::GroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features,
                             bool bias, std::optional<c10::Device> device,
                             std::optional<at::ScalarType> dtype, bool scale_bias)
    : BasicOperation("GroupedLinear", /*num_extra_inputs=*/bias && scale_bias ? 2 : 1),
      num_groups_(num_groups),
      in_features_(in_features),
      out_features_(out_features),
      has_bias_(bias),
      scale_bias_(bias && scale_bias) {
  TORCH_CHECK_VALUE(num_groups > 0, "GroupedLinear: expected num_groups > 0, got ", num_groups);
  TORCH_CHECK_VALUE(in_features > 0 && out_features > 0,
                    "GroupedLinear: expected positive in_features and out_features, got ",
                    in_features, " and ", out_features);
  const auto options = param_options(device, dtype);
  bool meta = false;
  for (int64_t g = 0; g < num_groups; ++g) {
    meta = register_parameter("weight" + std::to_string(g),
                              at::empty({out_features, in_features}, options))
               .is_meta();
  }
  if (bias) {
    for (int64_t g = 0; g < num_groups; ++g) {
      register_parameter("bias" + std::to_string(g), at::empty({out_features}, options));
    }
  }
  if (!meta) reset_parameters();
}

void GroupedLinear::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  const at::NoGradGuard no_grad;
  for (int64_t g = 0; g < num_groups_; ++g) {
    init_linear_weight_(*parameters_.find("weight" + std::to_string(g)));
    if (has_bias_) parameters_.find("bias" + std::to_string(g))->zero_();
  }
}

at::Tensor GroupedLinear::take_param_grad(size_t index, const at::Tensor& grad) {
  if (!main_grad_hook_ || index >= static_cast<size_t>(num_groups_)) return grad;
  return main_grad_hook_(static_cast<int64_t>(index), grad).value_or(at::Tensor());
}

std::vector<int64_t> GroupedLinear::split_sizes(const at::Tensor& sizes, int64_t rows) const {
  TORCH_CHECK_VALUE(sizes.scalar_type() == at::kInt || sizes.scalar_type() == at::kLong,
                    "GroupedLinear: expected split sizes of dtype int32 or int64, got ",
                    sizes.scalar_type());
  TORCH_CHECK_VALUE(sizes.dim() == 1 && sizes.numel() == num_groups_,
                    "GroupedLinear: expected split sizes of shape [", num_groups_,
                    "] (one per group), got ", sizes.sizes());
  const auto host = sizes.to(at::kCPU, at::kLong).contiguous();
  const auto* p = host.const_data_ptr<int64_t>();
  std::vector<int64_t> out(p, p + num_groups_);
  int64_t total = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    TORCH_CHECK_VALUE(out[g] >= 0, "GroupedLinear: expected non-negative split sizes, got ", out[g],
                      " for group ", g);
    total += out[g];
  }
  TORCH_CHECK_VALUE(total == rows, "GroupedLinear: expected split sizes summing to the input's ",
                    rows, " rows, got ", total);
  return out;
}

at::Tensor GroupedLinear::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                        const at::Tensor& input, const TensorLists& extra_inputs,
                                        TensorLists&, const ForwardArgs& args) {
  constexpr const char* op = "GroupedLinear";
  auto& ctx = *ctxs.at(0);
  const auto& w0 = ctx.param(0, op);
  check_input_against_param(op, input, w0);
  FUSIBLE_CHECK_MIN_DIM(op, "input", input, 1);
  TORCH_CHECK(input.size(-1) == in_features_,
              "GroupedLinear: expected input.size(-1) == ", "in_features (", in_features_,
              "), got ", input.size(-1), " (input shape ", shape_str(input), ")");
  const int64_t rows = input.numel() / in_features_;
  const auto sizes = split_sizes(extra_inputs.at(0).at(0), rows);
  ctx.compute_dtype = compute_dtype(args, w0.scalar_type());
  const auto x = cast_to(input, ctx.compute_dtype).reshape({rows, in_features_});
  std::vector<at::Tensor> weights;
  for (int64_t g = 0; g < num_groups_; ++g) {
    const auto& w = ctx.param(g, op);
    check_param_shape(op, "weight", w, {out_features_, in_features_});
    weights.push_back(cast_to(w, ctx.compute_dtype));
    if (has_bias_) check_param_shape(op, "bias", ctx.param(num_groups_ + g, op), {out_features_});
  }
  at::Tensor scales_in, scales;  // scale_bias: one per row; as given, and in the compute dtype
  if (scale_bias_) {
    scales_in = extra_inputs.at(0).at(1);
    FUSIBLE_CHECK_FLOATING(op, "scales", scales_in);
    FUSIBLE_CHECK_SAME_DEVICE(op, "input", input, "scales", scales_in);
    TORCH_CHECK(scales_in.dim() == 1 && scales_in.size(0) == rows,
                "GroupedLinear: expected scales of shape [", rows, "] (one per row), got ",
                scales_in.sizes());
    scales = cast_to(scales_in, ctx.compute_dtype);
  }
  std::vector<at::Tensor> biases;
  for (int64_t g = 0; has_bias_ && g < num_groups_; ++g) {
    biases.push_back(cast_to(ctx.param(num_groups_ + g, op), ctx.compute_dtype));
  }
  auto y = at::empty({rows, out_features_}, x.options());
  int64_t offset = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    const auto n = sizes[g];
    if (n > 0) {
      std::optional<at::Tensor> bias;
      if (has_bias_ && !scale_bias_) bias = biases[g];
      auto y_g = y.narrow(0, offset, n);
      y_g.copy_(kernels::linear_fwd(x.narrow(0, offset, n), weights[g], bias));
      if (scale_bias_) y_g.add_(scales.narrow(0, offset, n).unsqueeze(-1) * biases[g]);
    }
    offset += n;
  }
  if (ctx.requires_grad) {
    bool any_weight_grad = false;
    for (int64_t g = 0; g < num_groups_; ++g) any_weight_grad |= ctx.param_requires_grad.at(g);
    // (x, w0.., then with scale_bias: the scales and b0..)
    std::vector<at::Tensor> saved{any_weight_grad ? x : at::Tensor()};
    for (const auto& w : weights) saved.push_back(ctx.input_requires_grad ? w : at::Tensor());
    if (scale_bias_) {
      saved.push_back(scales_in);
      for (const auto& b : biases) saved.push_back(b);
    }
    ctx.save_for_backward(std::move(saved));
    ctx.state = c10::IValue(sizes);
  }
  auto shape = input.sizes().vec();
  shape.back() = out_features_;
  return y.reshape(shape);
}

BackwardResult GroupedLinear::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                             const at::Tensor& grad_output, const TensorLists&) {
  auto& ctx = *ctxs.at(0);
  const auto sizes = ctx.state.toIntVector();
  int64_t rows = 0;
  for (auto n : sizes) rows += n;
  const auto dy = cast_to(grad_output, ctx.compute_dtype).reshape({rows, out_features_});
  const auto& x = ctx.saved_tensors.at(0);
  at::Tensor dx;
  if (ctx.input_requires_grad) dx = at::empty({rows, in_features_}, dy.options());
  std::vector<at::Tensor> grads(ctx.param_requires_grad.size());
  // scale_bias: dbias_g = sum over rows of dy * scale, dscale[r] = dy[r] . b_g, in fp32.
  const auto& saved = ctx.saved_tensors;
  const auto f32 = at::promote_types(ctx.compute_dtype, at::kFloat);
  at::Tensor scales, dscales;
  if (scale_bias_) {
    scales = saved.at(1 + num_groups_);
    if (ctx.extra_input_requires_grad.size() > 1 && ctx.extra_input_requires_grad[1]) {
      dscales = at::zeros({rows}, dy.options().dtype(f32));
    }
  }
  int64_t offset = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    const auto n = sizes[g];
    const auto dy_g = dy.narrow(0, offset, n);
    if (dx.defined() && n > 0) {
      dx.narrow(0, offset, n).copy_(kernels::linear_dgrad(dy_g, saved.at(1 + g)));
    }
    if (ctx.param_requires_grad.at(g)) {
      grads[g] = n > 0 ? kernels::linear_wgrad(dy_g, x.narrow(0, offset, n))
                       : at::zeros({out_features_, in_features_}, dy.options());
    }
    if (has_bias_ && ctx.param_requires_grad.at(num_groups_ + g)) {
      if (n == 0) {
        grads[num_groups_ + g] = at::zeros({out_features_}, dy.options());
      } else if (scale_bias_) {
        grads[num_groups_ + g] = (dy_g.to(f32) * scales.narrow(0, offset, n).to(f32).unsqueeze(-1))
                                     .sum(0)
                                     .to(dy.scalar_type());
      } else {
        grads[num_groups_ + g] = kernels::bias_bwd(dy_g);
      }
    }
    if (dscales.defined() && n > 0) {
      dscales.narrow(0, offset, n)
          .copy_(at::mv(dy_g.to(f32), saved.at(2 + num_groups_ + g).to(f32)));
    }
    offset += n;
  }
  if (dx.defined()) {
    auto shape = grad_output.sizes().vec();
    shape.back() = in_features_;
    dx = dx.reshape(shape);
  }
  std::vector<at::Tensor> extra_grads{at::Tensor()};
  if (scale_bias_)
    extra_grads.push_back(dscales.defined() ? dscales.to(scales.scalar_type()) : dscales);
  return {dx, {grads}, {extra_grads}};
}

}  // namespace fusible::ops

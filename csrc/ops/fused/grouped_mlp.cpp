// GroupedMLP_GroupedGEMMGLU.
#include "ops/fused/grouped_mlp.h"

#include <tuple>

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

GroupedMLP_GroupedGEMMGLU::GroupedMLP_GroupedGEMMGLU(std::shared_ptr<GroupedLinear> fc1,
                                                     std::shared_ptr<ScaledSwiGLU> activation,
                                                     std::shared_ptr<GroupedLinear> fc2)
    : FusedOperation("GroupedMLP_GroupedGEMMGLU", {fc1, activation, fc2}),
      fc1_(std::move(fc1)),
      fc2_(std::move(fc2)),
      activation_(std::move(activation)) {}

at::Tensor GroupedMLP_GroupedGEMMGLU::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                                    const at::Tensor& input,
                                                    const TensorLists& extra_inputs, TensorLists&,
                                                    const ForwardArgs& args) {
  // Under FP8 each GroupedLinear reads the split sizes on the host; fc2 reuses fc1's read when
  // both take the same sizes tensor (a second read would wait for the device again).
  std::vector<int64_t> host_sizes;
  const auto h =
      fc1_->forward(*ctxs.at(0), input, extra_inputs.at(0), args, /*keep_input=*/true, &host_sizes);
  // The activation keeps h and the scales; fc2 keeps no input (recomputed in the backward; under
  // FP8 it keeps its cast input).
  TensorLists no_outputs(1);
  const auto a =
      activation_->fuser_forward({ctxs.at(1)}, h, {extra_inputs.at(1)}, no_outputs, args);
  const bool same_sizes = extra_inputs.at(2).at(0).is_same(extra_inputs.at(0).at(0));
  return fc2_->forward(*ctxs.at(2), a, extra_inputs.at(2), args, /*keep_input=*/false,
                       same_sizes ? &host_sizes : nullptr);
}

BackwardResult GroupedMLP_GroupedGEMMGLU::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                         const at::Tensor& grad_output,
                                                         const TensorLists&) {
  auto &fc1_ctx = *ctxs.at(0), &act_ctx = *ctxs.at(1), &fc2_ctx = *ctxs.at(2);
  const auto dy = fc2_->grad_operands(
      fc2_ctx, cast_to(grad_output, fc2_ctx.compute_dtype).reshape({-1, fc2_->out_features()}));
  const auto scales_shape = act_ctx.saved_tensors.at(1).sizes().vec();
  // Scopes and releases free each tensor once it is used, as the unfused plan's per-op backwards
  // would: fc2's input gradient, the recomputed fc2 input, the activation's saved input.
  at::Tensor dh, dscales;
  std::vector<at::Tensor> fc2_grads;
  at::Tensor fc2_dscales;
  {
    at::Tensor a;
    {
      const auto da = cast_to(fc2_->input_grad(fc2_ctx, dy), act_ctx.compute_dtype);
      // The activation's input and scales as [rows, 2F] and [rows] (the layout fc1 wrote).
      const auto h = act_ctx.saved_tensors.at(0).reshape({-1, fc1_->out_features()});
      const auto scales = act_ctx.saved_tensors.at(1).reshape({-1});
      if (fc2_ctx.fp8.on()) {  // fc2's wgrad reads the FP8 input it kept: no recompute
        std::tie(dh, dscales) = kernels::scaled_swiglu_bwd(da, h, scales);
      } else {
        std::tie(dh, dscales, a) = kernels::scaled_swiglu_bwd_fwd(da, h, scales);
      }
    }
    act_ctx.release_saved_tensor(0);
    std::tie(fc2_grads, fc2_dscales) = fc2_->param_grads(
        fc2_ctx, dy, a.defined() ? cast_to(a, fc2_ctx.compute_dtype) : at::Tensor());
  }
  const auto dh2 = fc1_->grad_operands(fc1_ctx, cast_to(dh, fc1_ctx.compute_dtype));
  dh = at::Tensor();
  at::Tensor dx = fc1_->input_grad(fc1_ctx, dh2);
  if (dx.defined()) {
    auto shape = grad_output.sizes().vec();
    shape.back() = fc1_->in_features();
    if (!dx.sizes().equals(shape)) dx = dx.reshape(shape);  // a caller's buffer is already
  }
  auto [fc1_grads, fc1_dscales] = fc1_->param_grads(fc1_ctx, dh2, at::Tensor());
  const bool scales_need_grad =
      !act_ctx.extra_input_requires_grad.empty() && act_ctx.extra_input_requires_grad[0];
  std::vector<at::Tensor> fc1_extra{at::Tensor()}, fc2_extra{at::Tensor()};
  if (fc1_->scale_bias()) fc1_extra.push_back(fc1_dscales);
  if (fc2_->scale_bias()) fc2_extra.push_back(fc2_dscales);
  return {
      dx,
      {fc1_grads, {}, fc2_grads},
      {fc1_extra, {scales_need_grad ? dscales.reshape(scales_shape) : at::Tensor()}, fc2_extra}};
}

OpList fuse_grouped_mlp(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto fc1 = op_at<GroupedLinear>(list, i);
    auto act = op_at<ScaledSwiGLU>(list, i + 1);
    auto fc2 = op_at<GroupedLinear>(list, i + 2);
    const bool fits = fc1 && act && fc2 && act->glu_interleave_size() == 0 &&
                      fc1->num_groups() == fc2->num_groups() &&
                      fc1->out_features() == 2 * fc2->in_features() &&
                      fctx.runs_backward(*fc1) == fctx.runs_backward(*fc2);
    if (!fits) return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<GroupedMLP_GroupedGEMMGLU>(fc1, act, fc2), 3};
  });
}

}  // namespace fusible::ops

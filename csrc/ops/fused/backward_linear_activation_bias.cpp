// BackwardLinearActivationBias.
#include "ops/fused/backward_linear_activation_bias.h"

#include <tuple>

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardLinearActivationBias::BackwardLinearActivationBias(
    std::shared_ptr<Bias> bias, std::shared_ptr<ElementwiseActivation> activation,
    std::shared_ptr<BasicLinear> linear)
    : FusedOperation("BackwardLinearActivationBias", {bias, activation, linear}),
      linear_(std::move(linear)),
      kind_(activation->kind()) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardLinearActivationBias::fuser_backward(
    const std::vector<OperationContext*>& ctxs, const at::Tensor& grad_output, const TensorLists&) {
  const auto& pre = ctxs.at(1)->saved_tensors.at(0);
  auto& linear_ctx = *ctxs.at(2);  // w is saved: the bias's backward runs
  auto& bias_ctx = *ctxs.at(0);
  at::Tensor dbias, amax;
  auto [dpre, dw] = linear_->backward_gemms(
      linear_ctx, cast_to(grad_output, linear_ctx.compute_dtype), 1.0,
      [&](const GemmOperand& dy, const GemmOperand& w) {
        at::Tensor dpre;
        if (pre.scalar_type() == linear_ctx.compute_dtype) {
          // The linear before casts dpre: max |dpre| from the activation pass where asked.
          std::tie(dpre, dbias) = gemms::dgrad_act_bias(
              dy, w, pre, kind_, bias_ctx.want_grad_input_amax ? &amax : nullptr);
        } else {  // mixed dtypes: the dgrad rounds to the activation's dtype first, as unfused
          std::tie(dpre, dbias) =
              kernels::bias_act_bwd(cast_to(gemms::dgrad(dy, w), pre.scalar_type()), pre, kind_);
        }
        return dpre;
      });
  if (amax.defined()) bias_ctx.grad_input_amax = {dpre, amax};
  if (!bias_ctx.param_requires_grad.at(0)) dbias = at::Tensor();
  return {dpre, {{dbias}, {}, {dw}}, {{}, {}, {}}};
}

OpList fuse_backward_linear_activation_bias(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto bias = op_at<Bias>(list, i);
    auto act = epilogue_activation_at(list, i + 1);
    auto linear = local_linear_at(list, i + 2);
    if (!bias || !act || !linear || !fctx.runs_backward(*bias)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardLinearActivationBias>(bias, act, linear), 3};
  });
}

}  // namespace fusible::ops

// BackwardActivationBias.
#include "ops/fused/backward_activation_bias.h"

#include <tuple>

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

BackwardActivationBias::BackwardActivationBias(std::shared_ptr<Bias> bias,
                                               std::shared_ptr<ElementwiseActivation> activation)
    : FusedOperation("BackwardActivationBias", {bias, activation}), kind_(activation->kind()) {
  set_fused_directions(/*forward=*/false, /*backward=*/true);
}

BackwardResult BackwardActivationBias::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                                      const at::Tensor& grad_output,
                                                      const TensorLists&) {
  const auto& act_ctx = *ctxs.at(1);
  auto& bias_ctx = *ctxs.at(0);
  const auto dy = cast_to(grad_output, act_ctx.compute_dtype);
  const auto& pre = act_ctx.saved_tensors.at(0);
  at::Tensor dpre, dbias, amax;
  if (bias_ctx.want_grad_input_amax) {  // the linear before casts dpre: max |dpre| from this pass
    std::tie(dpre, dbias, amax) = kernels::bias_act_bwd_amax(dy, pre, kind_);
    bias_ctx.grad_input_amax = {dpre, amax};
  } else {
    std::tie(dpre, dbias) = kernels::bias_act_bwd(dy, pre, kind_);
  }
  if (!ctxs.at(0)->param_requires_grad.at(0)) dbias = at::Tensor();
  return {dpre, {{dbias}, {}}, {{}, {}}};
}

OpList fuse_backward_activation_bias(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto bias = op_at<Bias>(list, i);
    auto act = epilogue_activation_at(list, i + 1);
    if (!bias || !act || !fctx.runs_backward(*bias)) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<BackwardActivationBias>(bias, act), 2};
  });
}

}  // namespace fusible::ops

// BackwardActivationBias.
#include "ops/fused/backward_activation_bias.h"

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
  auto [dpre, dbias] = kernels::bias_act_bwd(cast_to(grad_output, act_ctx.compute_dtype),
                                             act_ctx.saved_tensors.at(0), kind_);
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

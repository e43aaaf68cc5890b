// ForwardLinearBiasActivation.
#include "ops/fused/forward_linear_bias_activation.h"

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

ForwardLinearBiasActivation::ForwardLinearBiasActivation(
    std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
    std::shared_ptr<ElementwiseActivation> activation)
    : FusedOperation("ForwardLinearBiasActivation",
                     activation
                         ? std::vector<std::shared_ptr<BasicOperation>>{linear, bias, activation}
                         : std::vector<std::shared_ptr<BasicOperation>>{linear, bias}),
      linear_(std::move(linear)),
      bias_(std::move(bias)),
      activation_(std::move(activation)) {
  set_fused_directions(/*forward=*/true, /*backward=*/false);
  set_input_through_front_op();  // the input goes only to linear_->prepare_forward
}

at::Tensor ForwardLinearBiasActivation::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                                      const at::Tensor& input, const TensorLists&,
                                                      TensorLists&, const ForwardArgs& args) {
  auto& linear_ctx = *ctxs.at(0);
  auto& bias_ctx = *ctxs.at(1);
  const auto [x, w] = linear_->prepare_forward(linear_ctx, input, args);
  // The bias op sees the GEMM's output: same device and dtype as x after the cast.
  bias_ctx.input_dtype = linear_ctx.compute_dtype;
  const auto b = bias_->prepare_forward(bias_ctx, args);
  if (!activation_) return gemms::forward(x, w, b);
  ctxs.at(2)->input_dtype = bias_ctx.compute_dtype;
  // FP8 GEMMs here and a linear next: it casts act(pre) to FP8 from pre, so the GEMM writes pre
  // alone and nothing writes act(pre). (Where this GEMM is not FP8, say below fp8_min_tokens, the
  // epilogue below keeps the arithmetic of a run without FP8.)
  if (activation_->defers(*ctxs.at(2)) && linear_ctx.fp8.gemm_fp8) {
    auto pre = gemms::forward(x, w, b);
    activation_->fill_context(*ctxs.at(2), pre, pre, args);
    return activation_->defer_output(*ctxs.at(2), pre);
  }
  // ReLU's backward needs only y; without a backward nothing needs the pre-activation.
  if (activation_->saves_output() || !ctxs.at(2)->requires_grad) {
    auto y = gemms::forward_act(x, w, b, activation_->kind(), /*save_pre=*/false).first;
    activation_->fill_context(*ctxs.at(2), y, y, args);  // y stands for x: same dtype
    return y;
  }
  auto [y, pre] = gemms::forward_act(x, w, b, activation_->kind(), /*save_pre=*/true);
  activation_->fill_context(*ctxs.at(2), pre, y, args);  // saves pre, as the unfused op would
  return y;
}

OpList fuse_forward_linear_bias_activation(OpList ops, const FusionContext& fctx) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    std::pair<std::shared_ptr<FusibleOperation>, size_t> none{nullptr, 0};
    auto linear = local_linear_at(list, i);
    auto bias = op_at<Bias>(list, i + 1);
    if (!linear || !bias || bias->size() != linear->out_features() ||
        fctx.param_dtype(*bias, 0) != fctx.param_dtype(*linear, 0)) {
      return none;
    }
    auto act = epilogue_activation_at(list, i + 2);
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<ForwardLinearBiasActivation>(linear, bias, act), act ? 3 : 2};
  });
}

}  // namespace fusible::ops

// ForwardLinearScaleAdd.
#include "ops/fused/forward_linear_scale_add.h"

#include "ops/fused/forward_linear_bias_add.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

ForwardLinearScaleAdd::ForwardLinearScaleAdd(std::shared_ptr<BasicLinear> linear,
                                             std::shared_ptr<ConstantScale> scale,
                                             std::shared_ptr<AddExtraInput> add)
    : FusedOperation("ForwardLinearScaleAdd", {linear, scale, add}),
      linear_(std::move(linear)),
      scale_(std::move(scale)),
      add_(std::move(add)) {
  set_fused_directions(/*forward=*/true, /*backward=*/false);
  set_input_through_front_op();  // the input goes only to linear_->prepare_forward
}

at::Tensor ForwardLinearScaleAdd::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                                const at::Tensor& input,
                                                const TensorLists& extra_inputs, TensorLists&,
                                                const ForwardArgs& args) {
  auto& linear_ctx = *ctxs.at(0);
  const auto [x, w] = linear_->prepare_forward(linear_ctx, input, args);
  ctxs.at(1)->input_dtype = ctxs.at(2)->input_dtype = linear_ctx.compute_dtype;
  return linear_then_add(*add_, *ctxs.at(2), x, w, std::nullopt, scale_->scale(),
                         extra_inputs.at(2).at(0), args);
}

OpList fuse_forward_linear_scale_add(OpList ops, const FusionContext&) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    auto linear = local_linear_at(list, i);
    auto scale = op_at<ConstantScale>(list, i + 1);
    auto add = op_at<AddExtraInput>(list, i + 2);
    if (!linear || !scale || !add || !add->in_place()) {
      return std::pair<std::shared_ptr<FusibleOperation>, size_t>{nullptr, 0};
    }
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<ForwardLinearScaleAdd>(linear, scale, add), 3};
  });
}

}  // namespace fusible::ops

// ForwardLinearBiasActivation and its registration as a built-in forward fusion.
#include "ops/fused/forward_linear_bias_activation.h"

#include "kernels/ops.h"

namespace fusible::ops {

ForwardLinearBiasActivation::ForwardLinearBiasActivation(std::shared_ptr<BasicLinear> linear,
                                                         std::shared_ptr<Bias> bias)
    : FusedOperation("ForwardLinearBiasActivation", {linear, bias}),
      linear_(std::move(linear)),
      bias_(std::move(bias)) {
  set_fused_directions(/*forward=*/true, /*backward=*/false);
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
  return kernels::linear_fwd(x, w, b);
}

OpList fuse_forward_linear_bias_activation(OpList ops, const FusionContext& fctx) {
  OpList out;
  out.reserve(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    auto linear = std::dynamic_pointer_cast<BasicLinear>(ops[i]);
    auto bias = i + 1 < ops.size() ? std::dynamic_pointer_cast<Bias>(ops[i + 1]) : nullptr;
    if (linear && bias && bias->size() == linear->out_features() &&
        fctx.param_dtype(*bias, 0) == fctx.param_dtype(*linear, 0)) {
      out.push_back(std::make_shared<ForwardLinearBiasActivation>(linear, bias));
      ++i;
    } else {
      out.push_back(ops[i]);
    }
  }
  return out;
}

namespace {
// Built-in fusions register when libfusible loads, before any user registration.
[[maybe_unused]] const int64_t kRegistered = FusionRegistry::instance().add(
    "ForwardLinearBiasActivation", FusionPass::kForward, fuse_forward_linear_bias_activation);
}  // namespace

}  // namespace fusible::ops

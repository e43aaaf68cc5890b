// ForwardLinearBiasAdd.
#include "ops/fused/forward_linear_bias_add.h"

#include "kernels/dispatch.h"
#include "ops/fused/fusion_window.h"

namespace fusible::ops {

ForwardLinearBiasAdd::ForwardLinearBiasAdd(std::shared_ptr<BasicLinear> linear,
                                           std::shared_ptr<Bias> bias,
                                           std::shared_ptr<AddExtraInput> add)
    : FusedOperation(add->in_place() ? "ForwardLinearBiasAdd" : "ForwardLinearBiasAddOutOfPlace",
                     bias ? std::vector<std::shared_ptr<BasicOperation>>{linear, bias, add}
                          : std::vector<std::shared_ptr<BasicOperation>>{linear, add}),
      linear_(std::move(linear)),
      bias_(std::move(bias)),
      add_(std::move(add)) {
  set_fused_directions(/*forward=*/true, /*backward=*/false);
  set_input_through_front_op();  // the input goes only to linear_->prepare_forward
}

at::Tensor linear_then_add(AddExtraInput& add, OperationContext& add_ctx, const GemmOperand& x,
                           const GemmOperand& w, const std::optional<at::Tensor>& b, double alpha,
                           const at::Tensor& extra, const ForwardArgs& args) {
  TORCH_CHECK(extra.defined(), add.type_name(), ": expected an extra input tensor");
  // The GEMM's output shape is x's with the last dim out_features (no vector built per call).
  const auto xs = x.rowwise.sizes();
  const bool same_shape =
      extra.dim() == static_cast<int64_t>(xs.size()) &&
      extra.sizes().slice(0, xs.size() - 1).equals(xs.slice(0, xs.size() - 1)) &&
      extra.size(-1) == w.rowwise.size(0);
  if (extra.scalar_type() != x.dtype || !same_shape) {
    // The add op's own forward casts and broadcasts as it needs (rare: a residual in another
    // dtype or shape).
    // The bias in the GEMM's epilogue where nothing comes between, as the unfused Linear adds it
    // (one rounding to the compute dtype, the same bits).
    auto y = gemms::forward(x, w, alpha == 1.0 ? b : std::nullopt);
    if (alpha != 1.0) y = kernels::scale_fwd(y, alpha);
    if (b && alpha != 1.0) y = kernels::bias_fwd(y, *b);
    TensorLists unused_out(1);
    return add.fuser_forward({&add_ctx}, y, {{extra}}, unused_out, args);
  }
  const auto& xt = x.rowwise;  // what the GEMM reads: the output must not overlap it
  const bool in_place = add.writes_in_place(add_ctx, xt, extra) && !extra.is_alias_of(xt) &&
                        !extra.is_alias_of(w.rowwise);
  return gemms::forward_add(x, w, b, extra, alpha, in_place);
}

at::Tensor ForwardLinearBiasAdd::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                               const at::Tensor& input,
                                               const TensorLists& extra_inputs, TensorLists&,
                                               const ForwardArgs& args) {
  auto& linear_ctx = *ctxs.at(0);
  const auto [x, w] = linear_->prepare_forward(linear_ctx, input, args);
  std::optional<at::Tensor> b;
  if (bias_) {
    ctxs.at(1)->input_dtype = linear_ctx.compute_dtype;
    b = bias_->prepare_forward(*ctxs.at(1), args);
  }
  ctxs.back()->input_dtype = linear_ctx.compute_dtype;
  return linear_then_add(*add_, *ctxs.back(), x, w, b, 1.0, extra_inputs.back().at(0), args);
}

namespace {

// BasicLinear (+ Bias) + AddExtraInput whose in_place is the one asked for.
OpList fuse_linear_bias_add(OpList ops, const FusionContext& fctx, bool in_place) {
  return fuse_windows(ops, [&](const OpList& list, size_t i) {
    std::pair<std::shared_ptr<FusibleOperation>, size_t> none{nullptr, 0};
    auto linear = local_linear_at(list, i);
    if (!linear) return none;
    auto bias = op_at<Bias>(list, i + 1);
    if (bias && (bias->size() != linear->out_features() ||
                 fctx.param_dtype(*bias, 0) != fctx.param_dtype(*linear, 0))) {
      return none;
    }
    auto add = op_at<AddExtraInput>(list, i + (bias ? 2 : 1));
    if (!add || add->in_place() != in_place) return none;
    return std::pair<std::shared_ptr<FusibleOperation>, size_t>{
        std::make_shared<ForwardLinearBiasAdd>(linear, bias, add), bias ? 3 : 2};
  });
}

}  // namespace

OpList fuse_forward_linear_bias_add(OpList ops, const FusionContext& fctx) {
  return fuse_linear_bias_add(std::move(ops), fctx, /*in_place=*/true);
}

OpList fuse_forward_linear_bias_add_out_of_place(OpList ops, const FusionContext& fctx) {
  return fuse_linear_bias_add(std::move(ops), fctx, /*in_place=*/false);
}

}  // namespace fusible::ops

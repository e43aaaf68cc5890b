// BasicLinear through the linear GEMMs (ops/linear_gemms.h). Saves the input only when the weight
// needs a gradient and the weight only when the input does. Under an FP8 autocast its GEMMs take
// FP8 operands (ops/quantization.h): FP8 data and its transpose where FP8 GEMMs run (the saved
// tensors are then FP8 too), else casts to FP8 and back.
#include "ops/basic/basic_linear.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include "common/checks.h"
#include "kernels/dispatch.h"
#include "kernels/fp8/fp8_gemm.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {
namespace {

// A call's main_grad routing: the op's hook and the reduction in effect now (null without a hook).
std::shared_ptr<const MainGradCall> main_grad_call(
    const std::shared_ptr<const MainGrad>& hook, const std::optional<ProcessGroupSpec>& reduction) {
  return hook ? std::make_shared<const MainGradCall>(MainGradCall{hook, reduction}) : nullptr;
}

}  // namespace

TensorParallel checked_tensor_parallel(const char* op, TensorParallel tp, int64_t in_features,
                                       int64_t out_features) {
  TORCH_CHECK_VALUE(tp.mode.empty() || tp.mode == "column" || tp.mode == "row", op,
                    ": supported modes for tensor parallelism are None, \"row\" and \"column\" "
                    "(got mode='",
                    tp.mode, "')");
  TORCH_CHECK_VALUE(!tp.sequence_parallel || !tp.mode.empty(), op,
                    ": sequence_parallel needs tensor parallelism (tensor_parallel_mode \"column\" "
                    "or \"row\")");
  if (tp.mode.empty()) return {};
  check_process_group(op, tp.group);
  if (tp.group.size == 1) return {};
  const int64_t sharded = tp.mode == "column" ? out_features : in_features;
  TORCH_CHECK_VALUE(sharded % tp.group.size == 0, op,
                    ": invalid configuration for tensor parallelism (mode='", tp.mode, "', ",
                    tp.mode == "column" ? "out_features=" : "in_features=", sharded,
                    ", group_size=", tp.group.size, "): the sharded dim must divide evenly");
  return tp;
}

BasicLinear::BasicLinear(int64_t in_features, int64_t out_features,
                         std::optional<c10::Device> device, std::optional<at::ScalarType> dtype,
                         TensorParallel tp)
    : BasicOperation("BasicLinear"),
      in_features_(in_features),
      out_features_(out_features),
      tp_(checked_tensor_parallel("BasicLinear", std::move(tp), in_features, out_features)) {
  TORCH_CHECK_VALUE(in_features > 0 && out_features > 0,
                    "BasicLinear: expected positive in_features and out_features, got ",
                    in_features, " and ", out_features);
  if (tp_.mode == "column") out_features_ /= tp_.group.size;
  if (tp_.mode == "row") in_features_ /= tp_.group.size;
  const auto& w = register_parameter(
      "weight", at::empty({out_features_, in_features_}, param_options(device, dtype)));
  if (!w.is_meta()) reset_parameters();
}

void BasicLinear::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  init_linear_weight_(weight());
}

void BasicLinear::check_input_features(const at::Tensor& x) const {
  FUSIBLE_CHECK_MIN_DIM("BasicLinear", "input", x, 1);
  TORCH_CHECK(x.size(-1) == in_features_, "BasicLinear: expected input.size(-1) == in_features (",
              in_features_, "), got ", x.size(-1), " (input shape ", shape_str(x), ")");
}

std::pair<GemmOperand, GemmOperand> BasicLinear::prepare_forward(OperationContext& ctx,
                                                                 const at::Tensor& x,
                                                                 const ForwardArgs& args) {
  const auto& weight = ctx.param(0, "BasicLinear");
  check_param_shape("BasicLinear", "weight", weight, {out_features_, in_features_});
  check_input_against_param("BasicLinear", x, weight);
  check_input_features(x);
  ctx.compute_dtype = compute_dtype(args, weight.scalar_type());
  // Under an FP8 autocast the GEMMs see x and w cast to FP8 (and the backward, dy): fixed here, so
  // every fused forward and backward that goes through this op's forward and backward_gemms does.
  const int64_t rows = x.dim() > 0 && in_features_ > 0 ? x.numel() / in_features_ : 0;
  ctx.fp8 = fp8_cast(x, rows);
  ctx.fp8.gemm_fp8 =
      ctx.fp8.fp8_gemms_fit(rows, in_features_, out_features_, ctx.compute_dtype, x.device());
  const bool need_x = ctx.requires_grad && ctx.param_requires_grad.at(0);
  const bool need_w = ctx.requires_grad && ctx.input_requires_grad;
  // x may stand for act(pre), deferred by the op before: the FP8 cast reads pre and applies act
  // on the way in; otherwise act(pre) is computed here (and x is never read).
  const auto& deferred = ctx.input_act;
  const bool is_deferred = deferred.for_tensor(x);
  const bool cast_deferred =
      is_deferred && ctx.fp8.gemm_fp8 && deferred.pre.scalar_type() == ctx.compute_dtype;
  const auto xc = cast_to(
      is_deferred && !cast_deferred ? kernels::activation_fwd(deferred.pre, deferred.act) : x,
      ctx.compute_dtype);
  // A producer's amax of x, where it made this very x (the cast uses it only where it applies).
  auto xo = cast_deferred
                ? ctx.fp8.forward_operand(deferred.pre, 0, /*weight=*/false, /*rowwise=*/true,
                                          /*columnwise=*/need_x, {}, deferred.act)
                : ctx.fp8.forward_operand(xc, 0, /*weight=*/false, /*rowwise=*/true,
                                          /*columnwise=*/need_x, ctx.input_amax.for_tensor(xc));
  ctx.input_act = {};
  // A row-parallel linear under sequence parallelism casts dy after gathering it.
  ctx.takes_grad_output_amax = ctx.requires_grad && ctx.fp8.takes_produced_amax() &&
                               !(tp_.mode == "row" && tp_.sequence_parallel);
  // The dgrad reads w itself, or its FP8 transpose; under block scaling with 1x128 weight blocks
  // its column-wise cast (128x1 blocks) on the emulated path too.
  const bool w_columnwise = need_w && (ctx.fp8.gemm_fp8 || ctx.fp8.needs_columnwise());
  auto wo = ctx.fp8.forward_operand_from(weight, ctx.compute_dtype, 1, /*weight=*/true,
                                         /*rowwise=*/true, /*columnwise=*/w_columnwise);
  ctx.main_grad = need_x ? main_grad_call(main_grad_, param_grad_reduction()) : nullptr;
  if (ctx.requires_grad) {
    const auto& w_dgrad = w_columnwise ? wo.columnwise : wo.rowwise;
    ctx.save_for_backward({need_x ? xo.columnwise : at::Tensor(), need_w ? w_dgrad : at::Tensor()});
    if (ctx.fp8.gemm_fp8) {
      ctx.fp8.saved_scale_inv = {xo.columnwise_scale_inv, wo.columnwise_scale_inv};
    }
  }
  return {std::move(xo), std::move(wo)};
}

namespace {

// Saved slot i as a GEMM operand: FP8 data (with the scale_inv kept beside it) read as the
// transpose its GEMM takes, or a high-precision tensor as `hp_use` says.
GemmOperand saved_operand(const OperationContext& ctx, size_t i, bool hp_columnwise) {
  GemmOperand o;
  o.dtype = ctx.compute_dtype;
  const auto& t = ctx.saved_tensors.at(i);
  if (t.defined() && kernels::is_fp8(t)) {
    o.columnwise = t;
    o.columnwise_scale_inv = ctx.fp8.saved_scale_inv.at(i);
    o.block = ctx.fp8.gemm_block(/*backward=*/false, /*weight=*/i == 1);  // slots (x, w)
  } else {
    (hp_columnwise ? o.columnwise : o.rowwise) = t;
  }
  return o;
}

}  // namespace

GemmOperand BasicLinear::saved_input(const OperationContext& ctx) {
  return saved_operand(ctx, 0, /*hp_columnwise=*/true);  // the wgrad's
}

GemmOperand BasicLinear::saved_weight(const OperationContext& ctx) {
  return saved_operand(ctx, 1, /*hp_columnwise=*/false);  // the dgrad's
}

void BasicLinear::set_main_grad_hook(std::optional<MainGrad> main_grad) {
  if (main_grad) {
    TORCH_CHECK_VALUE(main_grad->target && main_grad->result,
                      "BasicLinear: set_main_grad_hook expects both target and result");
  }
  main_grad_ = main_grad ? std::make_shared<const MainGrad>(std::move(*main_grad)) : nullptr;
}

void BasicLinear::route_main_grad(OperationContext& ctx) const {
  if (!ctx.main_grad) ctx.main_grad = main_grad_call(main_grad_, param_grad_reduction());
}

at::Tensor BasicLinear::wgrad_into_main_grad(const MainGradCall& call, const GemmOperand& dy,
                                             const GemmOperand& x, double alpha) {
  const auto [buffer, overwrite] = call.hook->target();
  TORCH_CHECK(buffer.defined(), "BasicLinear: the main_grad target returned no tensor");
  const at::NoGradGuard no_grad;  // a buffer, not part of any graph
  if (!call.reduction) {
    gemms::wgrad_into(dy, x, buffer, alpha, /*accumulate=*/!overwrite);
  } else {  // each rank's gradient covers its own rows: summed over the group first
    auto dw = at::empty(buffer.sizes(), buffer.options());
    gemms::wgrad_into(dy, x, dw, alpha, /*accumulate=*/false);
    dw = wait(all_reduce_start("BasicLinear", dw, *call.reduction));
    overwrite ? buffer.copy_(dw) : buffer.add_(dw);
  }
  return call.hook->result().value_or(at::Tensor());
}

at::Tensor BasicLinear::op_forward(OperationContext& ctx, const at::Tensor& x,
                                   const ForwardArgs& args) {
  if (is_tensor_parallel()) return tensor_parallel_forward(ctx, x, args);
  const auto [xo, wo] = prepare_forward(ctx, x, args);
  return gemms::forward(xo, wo, std::nullopt);
}

bool BasicLinear::takes_input_amax() const {
  return !(tp_.mode == "column" && tp_.sequence_parallel);  // that one casts the gathered input
}

bool BasicLinear::takes_input_act() const {
  return !(tp_.mode == "column" && tp_.sequence_parallel);  // that one gathers the input first
}

std::string BasicLinear::plan_label(bool backward) const {
  const bool sp = tp_.sequence_parallel;
  std::string what;
  if (tp_.mode == "column") {
    what = backward ? (sp ? "reduce-scatter dgrad, overlapped" : "all-reduce dgrad, overlapped")
                    : (sp ? "all-gather input" : "");
  } else if (tp_.mode == "row") {
    what = backward ? (sp ? "all-gather grad" : "")
                    : (sp ? "reduce-scatter output" : "all-reduce output");
  }
  return what.empty() ? type_name() : type_name() + "[" + what + "]";
}

at::Tensor BasicLinear::tensor_parallel_forward(OperationContext& ctx, const at::Tensor& x,
                                                const ForwardArgs& args) {
  constexpr const char* op = "BasicLinear";
  const bool sp = tp_.sequence_parallel;
  if (sp) {
    // The ranks hold blocks of the tokens (dim 0): a 1-D input has no token dim, and gathering or
    // scattering its features would give a wrong result silently.
    TORCH_CHECK(x.dim() >= 2, op,
                ": sequence_parallel shards the tokens (dim 0) over the ranks: expected "
                "an input of at least 2 dims ([tokens, ..., features]), got shape ",
                shape_str(x));
    // Column mode gathers before prepare_forward's check would run: check the width given here.
    if (tp_.mode == "column") check_input_features(x);
  }
  // Column + sequence parallel: the rows of x are sharded; the GEMM (and the wgrad) take them all.
  const auto input = tp_.mode == "column" && sp ? wait(all_gather_start(op, x, tp_.group)) : x;
  const auto [xo, wo] = prepare_forward(ctx, input, args);
  auto y = gemms::forward(xo, wo, std::nullopt);
  if (tp_.mode == "row") {  // partial sums of every rank's input columns
    y = wait(sp ? reduce_scatter_start(op, y, tp_.group) : all_reduce_start(op, y, tp_.group));
  }
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> BasicLinear::tensor_parallel_backward(
    OperationContext& ctx, const at::Tensor& dy_in) {
  constexpr const char* op = "BasicLinear";
  const bool sp = tp_.sequence_parallel, column = tp_.mode == "column";
  auto dy = cast_to(dy_in, ctx.compute_dtype);
  if (!column && sp) dy = wait(all_gather_start(op, dy, tp_.group));
  // Column parallel: dx is a partial sum over the ranks' output features; its reduction starts
  // right after the dgrad, runs while the wgrad computes (te's overlap) and is waited for last.
  auto [dx, dw] = backward_gemms(
      ctx, dy, 1.0,
      [&](const GemmOperand& g, const GemmOperand& w) {
        auto partial = gemms::dgrad(g, w);
        if (!column) return partial;
        return sp ? reduce_scatter_start(op, partial, tp_.group)
                  : all_reduce_start(op, partial, tp_.group);
      },
      /*dgrad_first=*/column);
  if (dx.defined() && column) dx = wait(dx);
  return {dx, {dw}};
}

std::pair<at::Tensor, std::vector<at::Tensor>> BasicLinear::op_backward(OperationContext& ctx,
                                                                        const at::Tensor& dy) {
  if (is_tensor_parallel()) return tensor_parallel_backward(ctx, dy);
  // dw in the compute dtype: the fuser casts it to the weight's.
  auto [dx, dw] =
      backward_gemms(ctx, cast_to(dy, ctx.compute_dtype), 1.0,
                     [](const GemmOperand& g, const GemmOperand& w) { return gemms::dgrad(g, w); });
  return {dx, {dw}};
}

}  // namespace fusible::ops

// Activation ops through fusible::activation_* / glu_* / clamped_swiglu_* / scaled_swiglu_*.
#include "ops/basic/activations.h"

#include "common/checks.h"
#include "kernels/ops.h"

namespace fusible::ops {
namespace {

// Checks the input and returns the dtype to compute in (autocast's, else the input's).
at::ScalarType activation_dtype(const char* op, const at::Tensor& x, const ForwardArgs& args) {
  FUSIBLE_CHECK_FLOATING(op, "input", x);
  return args.autocast_dtype.value_or(x.scalar_type());
}

void check_even_last_dim(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, op,
              ": expected input with an even last dim (it is split in halves), got shape ",
              shape_str(x));
}

}  // namespace

void ElementwiseActivation::fill_context(OperationContext& ctx, const at::Tensor& x,
                                         const at::Tensor& y, const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype(type_name().c_str(), saves_output() ? y : x, args);
  if (ctx.requires_grad) ctx.save_for_backward({saves_output() ? y : x});
}

at::Tensor ElementwiseActivation::op_forward(OperationContext& ctx, const at::Tensor& x,
                                             const ForwardArgs& args) {
  const auto xc = cast_to(x, activation_dtype(type_name().c_str(), x, args));
  auto y = kernels::activation_fwd(xc, kind_);
  fill_context(ctx, xc, y, args);
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> ElementwiseActivation::op_backward(
    OperationContext& ctx, const at::Tensor& dy) {
  // For ReLU the saved tensor is the output: relu_bwd's [saved > 0] is the same mask.
  return {kernels::activation_bwd(cast_to(dy, ctx.compute_dtype), ctx.saved_tensors.at(0), kind_),
          {}};
}

at::Tensor GatedActivation::op_forward(OperationContext& ctx, const at::Tensor& x,
                                       const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype(type_name().c_str(), x, args);
  check_even_last_dim(type_name().c_str(), x);
  const auto xc = cast_to(x, ctx.compute_dtype);
  if (ctx.requires_grad) ctx.save_for_backward({xc});
  return kernels::glu_fwd(xc, kind_);
}

std::pair<at::Tensor, std::vector<at::Tensor>> GatedActivation::op_backward(OperationContext& ctx,
                                                                            const at::Tensor& dy) {
  return {kernels::glu_bwd(cast_to(dy, ctx.compute_dtype), ctx.saved_tensors.at(0), kind_), {}};
}

at::Tensor ClampedSwiGLU::op_forward(OperationContext& ctx, const at::Tensor& x,
                                     const ForwardArgs& args) {
  ctx.compute_dtype = activation_dtype("ClampedSwiGLU", x, args);
  check_even_last_dim("ClampedSwiGLU", x);
  const auto xc = cast_to(x, ctx.compute_dtype);
  if (ctx.requires_grad) ctx.save_for_backward({xc});
  return kernels::clamped_swiglu_fwd(xc, limit_, alpha_);
}

std::pair<at::Tensor, std::vector<at::Tensor>> ClampedSwiGLU::op_backward(OperationContext& ctx,
                                                                          const at::Tensor& dy) {
  return {kernels::clamped_swiglu_bwd(cast_to(dy, ctx.compute_dtype), ctx.saved_tensors.at(0),
                                      limit_, alpha_),
          {}};
}

at::Tensor ScaledSwiGLU::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                       const at::Tensor& input, const TensorLists& extra_inputs,
                                       TensorLists&, const ForwardArgs& args) {
  auto& ctx = *ctxs.at(0);
  ctx.compute_dtype = activation_dtype("ScaledSwiGLU", input, args);
  check_even_last_dim("ScaledSwiGLU", input);
  const auto& scales = extra_inputs.at(0).at(0);
  FUSIBLE_CHECK_FLOATING("ScaledSwiGLU", "scales", scales);
  TORCH_CHECK(scales.sizes().equals(input.sizes().slice(0, input.dim() - 1)),
              "ScaledSwiGLU: expected scales of shape ", input.sizes().slice(0, input.dim() - 1),
              " (the input's shape without the last dim), got ", scales.sizes());
  const auto xc = cast_to(input, ctx.compute_dtype);
  if (ctx.requires_grad) ctx.save_for_backward({xc, scales});
  return kernels::scaled_swiglu_fwd(xc, scales);
}

BackwardResult ScaledSwiGLU::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                            const at::Tensor& grad_output, const TensorLists&) {
  auto& ctx = *ctxs.at(0);
  const auto& s = ctx.saved_tensors;
  auto [dx, dscales] =
      kernels::scaled_swiglu_bwd(cast_to(grad_output, ctx.compute_dtype), s.at(0), s.at(1));
  const bool scales_need_grad =
      !ctx.extra_input_requires_grad.empty() && ctx.extra_input_requires_grad[0];
  return {dx, {{}}, {{scales_need_grad ? dscales : at::Tensor()}}};
}

}  // namespace fusible::ops

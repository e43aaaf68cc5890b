// AddExtraInput and MakeExtraOutput.
#include "ops/basic/extra_io.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/sum_to_size.h>

#include <vector>

#include "common/checks.h"
#include "kernels/dispatch.h"

namespace fusible::ops {

namespace {

// The shape input + extra broadcasts to (at::infer_size), or an error naming the op.
std::vector<int64_t> broadcast_shape(const at::Tensor& input, const at::Tensor& extra) {
  try {
    return at::infer_size(input.sizes(), extra.sizes());
  } catch (const c10::Error&) {
    TORCH_CHECK(false,
                "AddExtraInput: expected an extra input that broadcasts with the input's "
                "shape ",
                input.sizes(), ", got ", extra.sizes());
  }
}

}  // namespace

at::Tensor AddExtraInput::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                        const at::Tensor& input, const TensorLists& extra_inputs,
                                        TensorLists&, const ForwardArgs&) {
  const auto& extra = extra_inputs.at(0).at(0);
  FUSIBLE_CHECK_FLOATING("AddExtraInput", "extra input", extra);
  TORCH_CHECK(extra.device() == input.device(), "AddExtraInput: expected extra input on ",
              input.device(), ", got ", extra.device());
  auto& ctx = *ctxs.at(0);
  ctx.state = c10::IValue();
  if (!extra.sizes().equals(input.sizes())) {
    // te.ops adds with broadcasting: y has the broadcast shape; the backward sums each gradient
    // back to its tensor's shape.
    const auto shape = broadcast_shape(input, extra);
    ctx.input_shape = input.sizes().vec();
    ctx.state = c10::IValue(extra.sizes().vec());
    if (writes_in_place(ctx, input, extra) && extra.sizes().equals(shape)) {
      kernels::add_(extra, input.expand(shape).contiguous());
      return extra;
    }
    return kernels::add_fwd(input.expand(shape).contiguous(), extra.expand(shape).contiguous());
  }
  if (!writes_in_place(ctx, input, extra)) return kernels::add_fwd(input, extra);
  kernels::add_(extra, input);
  return extra;
}

bool AddExtraInput::writes_in_place(const OperationContext& ctx, const at::Tensor& x,
                                    const at::Tensor& extra) const {
  const bool writable = ctx.extra_input_writable.empty() || ctx.extra_input_writable.at(0);
  // Not into a view: marking a view dirty rebases its history onto this node's first input (x),
  // and x's gradient was lost. Adding out of place gives the same values.
  return in_place_ && writable && !extra.is_view() &&
         extra.unsafeGetTensorImpl() != x.unsafeGetTensorImpl();
}

BackwardResult AddExtraInput::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                             const at::Tensor& grad_output, const TensorLists&) {
  const auto& ctx = *ctxs.at(0);
  if (ctx.state.isNone()) return {grad_output, {{}}, {{grad_output}}};
  // Broadcast in the forward: each gradient summed back to its tensor's shape.
  const auto extra_shape = ctx.state.toIntVector();
  return {grad_output.sum_to_size(ctx.input_shape), {{}}, {{grad_output.sum_to_size(extra_shape)}}};
}

at::Tensor MakeExtraOutput::fuser_forward(const std::vector<OperationContext*>&,
                                          const at::Tensor& input, const TensorLists&,
                                          TensorLists& extra_outputs, const ForwardArgs&) {
  extra_outputs.at(0) = {input};
  return input;
}

BackwardResult MakeExtraOutput::fuser_backward(const std::vector<OperationContext*>&,
                                               const at::Tensor& grad_output,
                                               const TensorLists& grad_extra_outputs) {
  const auto& dextra = grad_extra_outputs.at(0).at(0);
  if (!dextra.defined()) return {grad_output, {{}}, {{}}};
  if (!grad_output.defined()) return {dextra, {{}}, {{}}};
  // Always out of place: dy may be the caller's tensor or a buffer autograd also hands to other
  // nodes (AddExtraInput returns one tensor as two gradients), so writing into it is unsafe.
  return {kernels::add_fwd(grad_output, dextra), {{}}, {{}}};
}

}  // namespace fusible::ops

// AddExtraInput and MakeExtraOutput.
#include "ops/basic/extra_io.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/result_type.h>
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
  const bool same_shape = extra.sizes().equals(input.sizes());
  const bool in_place = writes_in_place(ctx, input, extra);
  // Out of place, te.ops adds as torch does: y in the promoted dtype (a bf16 block's output added
  // to an fp32 residual stays fp32). With in_place, y is extra's dtype (te.ops' extra += x), also
  // where the op adds out of place instead (see writes_in_place): the same sum, in a new tensor.
  const auto dtype = in_place_ ? extra.scalar_type() : at::result_type(input, extra);
  if (!same_shape || extra.scalar_type() != dtype) {
    // The backward sums each gradient back to its tensor's shape and returns extra's in its dtype.
    ctx.input_shape = input.sizes().vec();
    ctx.state = c10::IValue(
        std::make_tuple(extra.sizes().vec(), static_cast<int64_t>(extra.scalar_type())));
  }
  // te.ops' in-place add is torch's extra += x, where a 0-dim x takes no part in type promotion:
  // it is rounded to extra's dtype first (a 0-dim extra makes both operands count).
  auto x = in_place_ && input.dim() == 0 && extra.dim() > 0 ? cast_to(input, extra.scalar_type())
                                                            : input;
  if (!same_shape) {
    // te.ops adds with broadcasting: y has the broadcast shape.
    const auto shape = broadcast_shape(input, extra);
    // te.ops' extra += x raises where extra cannot hold the sum; adding out of place instead
    // would leave the caller's tensor unwritten.
    TORCH_CHECK(!in_place_ || extra.sizes().equals(shape),
                "AddExtraInput(in_place=True): expected an extra input that holds the sum "
                "(shape ",
                c10::IntArrayRef(shape), "), got shape ", extra.sizes(),
                "; in_place=False adds out of place with broadcasting");
    if (!in_place_) {
      return kernels::add_fwd(cast_to(input, dtype).expand(shape).contiguous(),
                              cast_to(extra, dtype).expand(shape).contiguous());
    }
    x = x.expand(shape).contiguous();
  }
  if (in_place_) {
    if (!in_place) return kernels::add_fwd(extra, x);  // rounded once to extra's dtype, as +=
    kernels::add_(extra, x);
    return extra;
  }
  // The operand already in the sum's dtype goes first: add_fwd adds the other in one pass,
  // without a cast kernel and its copy (a bf16 block output onto an fp32 residual stream).
  if (input.scalar_type() == dtype) return kernels::add_fwd(input, extra);
  if (extra.scalar_type() == dtype) return kernels::add_fwd(extra, input);
  return kernels::add_fwd(cast_to(input, dtype), cast_to(extra, dtype));
}

bool AddExtraInput::writes_in_place(const OperationContext& ctx, const at::Tensor& x,
                                    const at::Tensor& extra) const {
  const bool writable = ctx.extra_input_writable.empty() || ctx.extra_input_writable.at(0);
  // Not into a view where the call records a node: marking a view dirty rebases its history onto
  // this node's first input (x), and x's gradient was lost. Adding out of place gives the same
  // values. Without a node (no_grad, nothing requires grad) it writes a slice of a buffer as
  // te.ops does.
  return in_place_ && writable && (!extra.is_view() || !ctx.call_records_node) &&
         extra.unsafeGetTensorImpl() != x.unsafeGetTensorImpl();
}

BackwardResult AddExtraInput::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                             const at::Tensor& grad_output, const TensorLists&) {
  const auto& ctx = *ctxs.at(0);
  if (ctx.state.isNone()) return {grad_output, {{}}, {{grad_output}}};
  // Broadcast or promoted in the forward: each gradient summed back to its tensor's shape, extra's
  // in its dtype (the fuser returns the input's in the input's dtype).
  const auto extra = ctx.state.toTuple();
  const auto extra_shape = extra->elements().at(0).toIntVector();
  const auto extra_dtype = static_cast<at::ScalarType>(extra->elements().at(1).toInt());
  return {grad_output.sum_to_size(ctx.input_shape),
          {{}},
          {{cast_to(grad_output.sum_to_size(extra_shape), extra_dtype)}}};
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

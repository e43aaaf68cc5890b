// AddExtraInput and MakeExtraOutput.
#include "ops/basic/extra_io.h"

#include "common/checks.h"
#include "kernels/ops.h"

namespace fusible::ops {

at::Tensor AddExtraInput::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                        const at::Tensor& input, const TensorLists& extra_inputs,
                                        TensorLists&, const ForwardArgs&) {
  const auto& extra = extra_inputs.at(0).at(0);
  FUSIBLE_CHECK_FLOATING("AddExtraInput", "extra input", extra);
  TORCH_CHECK(extra.sizes().equals(input.sizes()), "AddExtraInput: expected extra input of shape ",
              input.sizes(), " (the input's), got ", extra.sizes());
  TORCH_CHECK(extra.device() == input.device(), "AddExtraInput: expected extra input on ",
              input.device(), ", got ", extra.device());
  if (!writes_in_place(*ctxs.at(0), input, extra)) return kernels::add_fwd(input, extra);
  kernels::add_(extra, input);
  return extra;
}

bool AddExtraInput::writes_in_place(const OperationContext& ctx, const at::Tensor& x,
                                    const at::Tensor& extra) const {
  const bool from_caller = ctx.extra_input_from_caller.empty() || ctx.extra_input_from_caller.at(0);
  return in_place_ && from_caller && extra.unsafeGetTensorImpl() != x.unsafeGetTensorImpl();
}

BackwardResult AddExtraInput::fuser_backward(const std::vector<OperationContext*>&,
                                             const at::Tensor& grad_output, const TensorLists&) {
  return {grad_output, {{}}, {{grad_output}}};
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

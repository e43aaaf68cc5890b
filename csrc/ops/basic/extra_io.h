// Ops that exchange tensors with the caller or other ops: AddExtraInput (y = x + extra) and
// MakeExtraOutput (y = x, extra = x). Both save nothing for backward.
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// y = x + extra (extra input 0). in_place: adds into extra's storage and returns it.
class AddExtraInput : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit AddExtraInput(bool in_place = false)
      : BasicOperation("AddExtraInput", /*num_extra_inputs=*/1), in_place_(in_place) {}
  bool in_place() const { return in_place_; }
  bool writes_extra_inputs() const override { return in_place_; }
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;
  /// Whether x + extra is written into extra's storage: in_place, and extra is a positional extra
  /// tensor of the caller (OperationContext::extra_input_writable), not a view, other than x.
  bool writes_in_place(const OperationContext& ctx, const at::Tensor& x,
                       const at::Tensor& extra) const;

 private:
  bool in_place_;
};

/// y = x and extra output 0 = x (the same tensor); dx = dy + d(extra). in_place: the extra
/// gradient is accumulated into dy's storage when it can be.
class MakeExtraOutput : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit MakeExtraOutput(bool in_place = false)
      : BasicOperation("MakeExtraOutput", 0, /*num_extra_outputs=*/1), in_place_(in_place) {}
  bool in_place() const { return in_place_; }
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  bool in_place_;
};

}  // namespace fusible::ops

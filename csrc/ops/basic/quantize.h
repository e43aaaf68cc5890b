// Quantize: casts x (forward) and/or dy (backward) to FP8 under an FP8 autocast; identity
// otherwise (te.ops' Quantize).
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

class Quantize : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit Quantize(bool forward = true, bool backward = false)
      : BasicOperation("Quantize"), forward_(forward), backward_(backward) {}
  bool quantizes_forward() const { return forward_; }
  bool quantizes_backward() const { return backward_; }
  std::pair<int64_t, int64_t> num_quantizers() const override { return {forward_, backward_}; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
  /// The scale its latest backward cast used under DelayedScaling (undefined otherwise): what a
  /// binding that hands the gradient out quantized records it with.
  const at::Tensor& last_backward_scale() const { return last_backward_scale_; }

 private:
  bool forward_;
  bool backward_;
  at::Tensor last_backward_scale_;
};

}  // namespace fusible::ops

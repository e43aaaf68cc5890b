// Quantize: the forward's recipe decides both directions (the backward may run outside the
// autocast).
#include "ops/basic/quantize.h"

namespace fusible::ops {

at::Tensor Quantize::op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) {
  const auto cast = fp8_cast(x);
  if (backward_) ctx.fp8 = cast;
  return forward_ ? cast.forward(x, 0) : x;
}

std::pair<at::Tensor, std::vector<at::Tensor>> Quantize::op_backward(OperationContext& ctx,
                                                                     const at::Tensor& dy) {
  // Off unless backward_ was set under an FP8 autocast.
  const auto& state = ctx.fp8.state;
  last_backward_scale_ = state && !state->backward.empty() ? state->backward[0].scale.clone()
                                                           : at::Tensor();  // none: not delayed
  return {ctx.fp8.backward(dy), {}};
}

}  // namespace fusible::ops

// Dropout through fusible::dropout_fwd / dropout_bwd; the keep-mask is saved for backward.
#include "ops/basic/dropout.h"

#include "common/checks.h"
#include "kernels/dispatch.h"

namespace fusible::ops {

Dropout::Dropout(double p) : BasicOperation("Dropout"), p_(p) {
  TORCH_CHECK_VALUE(p >= 0 && p <= 1, "Dropout: expected 0 <= p <= 1, got ", p);
}

at::Tensor Dropout::op_forward(OperationContext& ctx, const at::Tensor& x_in,
                               const ForwardArgs& args) {
  FUSIBLE_CHECK_FLOATING("Dropout", "input", x_in);
  if (!is_training()) {  // x as it is, as te.ops' evaluation
    ctx.compute_dtype = x_in.scalar_type();
    ctx.save_for_backward({at::Tensor()});
    return x_in;
  }
  // Training: in torch.autocast's dtype when on, as te.ops' Dropout and fusible's activations
  // (the gradient goes back in the input's dtype).
  const auto x = cast_to(x_in, args.autocast_dtype.value_or(x_in.scalar_type()));
  ctx.compute_dtype = x.scalar_type();
  if (p_ == 0) {
    ctx.save_for_backward({at::Tensor()});
    return x;
  }
  auto [y, mask] = kernels::dropout_fwd(x, p_);
  if (ctx.requires_grad) ctx.save_for_backward({mask});
  return y;
}

std::pair<at::Tensor, std::vector<at::Tensor>> Dropout::op_backward(OperationContext& ctx,
                                                                    const at::Tensor& dy) {
  const auto& mask = ctx.saved_tensors.at(0);
  return {mask.defined() ? kernels::dropout_bwd(dy, mask, p_) : dy, {}};
}

}  // namespace fusible::ops

// Identity, Reshape and ConstantScale.
#include "ops/basic/simple_ops.h"

#include <ATen/InferSize.h>

#include "kernels/dispatch.h"

namespace fusible::ops {

at::Tensor Identity::op_forward(OperationContext&, const at::Tensor& x, const ForwardArgs&) {
  return x;
}

std::pair<at::Tensor, std::vector<at::Tensor>> Identity::op_backward(OperationContext&,
                                                                     const at::Tensor& dy) {
  return {dy, {}};
}

Reshape::Reshape(std::vector<int64_t> shape) : BasicOperation("Reshape"), shape_(std::move(shape)) {
  int64_t inferred = 0;
  for (auto s : shape_) {
    TORCH_CHECK_VALUE(s >= -1, "Reshape: expected sizes >= -1, got ", s);
    inferred += s == -1;
  }
  TORCH_CHECK_VALUE(inferred <= 1, "Reshape: expected at most one -1 in shape, got ", inferred);
}

at::Tensor Reshape::op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) {
  ctx.input_shape = x.sizes().vec();
  try {
    at::infer_size(shape_, x.numel());  // the error names the op, not only ATen's view
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "Reshape: expected an input whose ", x.numel(), " elements fit shape ",
                c10::IntArrayRef(shape_), ", got shape ", x.sizes());
  }
  return x.reshape(shape_);
}

std::pair<at::Tensor, std::vector<at::Tensor>> Reshape::op_backward(OperationContext& ctx,
                                                                    const at::Tensor& dy) {
  int64_t numel = 1;
  for (auto s : ctx.input_shape) numel *= s;
  TORCH_CHECK(!ctx.input_shape.empty() || dy.numel() == 1,
              "Reshape: its context holds no input shape (a fused forward that replaced it must ",
              "set ctx.input_shape)");
  TORCH_CHECK(numel == dy.numel(), "Reshape: expected a gradient with ", numel,
              " elements (input shape ", c10::IntArrayRef(ctx.input_shape), "), got ", dy.numel());
  return {dy.reshape(ctx.input_shape), {}};
}

at::Tensor ConstantScale::op_forward(OperationContext&, const at::Tensor& x, const ForwardArgs&) {
  return kernels::scale_fwd(x, scale_);
}

std::pair<at::Tensor, std::vector<at::Tensor>> ConstantScale::op_backward(OperationContext&,
                                                                          const at::Tensor& dy) {
  return {kernels::scale_fwd(dy, scale_), {}};
}

}  // namespace fusible::ops

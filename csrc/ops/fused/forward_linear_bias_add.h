// ForwardLinearBiasAdd (te.ops' name): BasicLinear (+ Bias) + AddExtraInput(in_place=True) forward
// as one GEMM that accumulates into the extra tensor (beta = 1). Ours,
// ForwardLinearBiasAddOutOfPlace: the same with AddExtraInput(in_place=False), the GEMM reading the
// extra tensor as its C input and writing a new output (te.ops leaves that pair unfused).
// Forward-only.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/basic/extra_io.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class ForwardLinearBiasAdd : public FusedOperation {
 public:
  /// bias may be null. The name follows the add op's in_place.
  ForwardLinearBiasAdd(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
                       std::shared_ptr<AddExtraInput> add);
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<Bias> bias_;
  std::shared_ptr<AddExtraInput> add_;
};

/// BasicLinear, optionally a Bias (its out_features, the weight's dtype), then an
/// AddExtraInput(in_place=True).
OpList fuse_forward_linear_bias_add(OpList ops, const FusionContext& ctx);
/// The same window with an AddExtraInput(in_place=False).
OpList fuse_forward_linear_bias_add_out_of_place(OpList ops, const FusionContext& ctx);

/// Shared by the forward GEMM + add fusions: y = alpha * x W^T + b + extra, written into extra
/// where the add op would write in place, else into a new tensor. Falls back to the add op's own
/// forward when extra's dtype is not the GEMM's.
at::Tensor linear_then_add(AddExtraInput& add, OperationContext& add_ctx, const GemmOperand& x,
                           const GemmOperand& w, const std::optional<at::Tensor>& b, double alpha,
                           const at::Tensor& extra, const ForwardArgs& args);

}  // namespace fusible::ops

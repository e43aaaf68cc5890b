// BackwardAddRMSNorm (te.ops' name) and its LayerNorm twin BackwardAddLayerNorm: MakeExtraOutput +
// norm backward as one pass that adds the extra output's gradient to the norm's input gradient.
// As te.ops: only when MakeExtraOutput is not in place. Backward-only.
#pragma once

#include "ops/basic/extra_io.h"
#include "ops/basic/norms.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

class BackwardAddRMSNorm : public FusedOperation {
 public:
  BackwardAddRMSNorm(std::shared_ptr<MakeExtraOutput> make, std::shared_ptr<RMSNorm> norm);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<RMSNorm> norm_;
};

class BackwardAddLayerNorm : public FusedOperation {
 public:
  BackwardAddLayerNorm(std::shared_ptr<MakeExtraOutput> make, std::shared_ptr<LayerNorm> norm);
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  std::shared_ptr<LayerNorm> norm_;
};

/// MakeExtraOutput(in_place=False), then RMSNorm, both running backward.
OpList fuse_backward_add_rmsnorm(OpList ops, const FusionContext& ctx);
/// MakeExtraOutput(in_place=False), then LayerNorm, both running backward.
OpList fuse_backward_add_layernorm(OpList ops, const FusionContext& ctx);

}  // namespace fusible::ops

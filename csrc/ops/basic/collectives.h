// te.ops' collective ops along dim 0 over a torch.distributed process group: AllGather (backward:
// reduce-scatter), ReduceScatter (backward: all-gather), AllReduce (a sum; backward: identity, the
// gradient being the same on every rank). One process: identity.
#pragma once

#include "ops/distributed.h"
#include "ops/fusible_operation.h"

namespace fusible::ops {

class Collective : public BasicOperation {
 public:
  Collective(std::string name, ProcessGroupSpec group);
  const ProcessGroupSpec& process_group() const { return group_; }

 protected:
  ProcessGroupSpec group_;
};

class AllGather : public Collective {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit AllGather(ProcessGroupSpec group) : Collective("AllGather", std::move(group)) {}
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
};

class ReduceScatter : public Collective {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ReduceScatter(ProcessGroupSpec group) : Collective("ReduceScatter", std::move(group)) {}
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
};

class AllReduce : public Collective {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit AllReduce(ProcessGroupSpec group) : Collective("AllReduce", std::move(group)) {}
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x, const ForwardArgs&) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
};

}  // namespace fusible::ops

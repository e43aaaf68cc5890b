// AllGather, ReduceScatter, AllReduce.
#include "ops/basic/collectives.h"

namespace fusible::ops {

Collective::Collective(std::string name, ProcessGroupSpec group)
    : BasicOperation(name), group_(std::move(group)) {
  check_process_group(name.c_str(), group_);
}

at::Tensor AllGather::op_forward(OperationContext&, const at::Tensor& x, const ForwardArgs&) {
  if (group_.size == 1) return x;
  return wait(all_gather_start("AllGather", x, group_));
}

std::pair<at::Tensor, std::vector<at::Tensor>> AllGather::op_backward(OperationContext&,
                                                                      const at::Tensor& dy) {
  if (group_.size == 1) return {dy, {}};
  return {wait(reduce_scatter_start("AllGather", dy, group_)), {}};
}

at::Tensor ReduceScatter::op_forward(OperationContext&, const at::Tensor& x, const ForwardArgs&) {
  if (group_.size == 1) return x;
  return wait(reduce_scatter_start("ReduceScatter", x, group_));
}

std::pair<at::Tensor, std::vector<at::Tensor>> ReduceScatter::op_backward(OperationContext&,
                                                                          const at::Tensor& dy) {
  if (group_.size == 1) return {dy, {}};
  return {wait(all_gather_start("ReduceScatter", dy, group_)), {}};
}

at::Tensor AllReduce::op_forward(OperationContext&, const at::Tensor& x, const ForwardArgs&) {
  if (group_.size == 1) return x;
  return wait(all_reduce_start("AllReduce", x, group_));
}

std::pair<at::Tensor, std::vector<at::Tensor>> AllReduce::op_backward(OperationContext&,
                                                                      const at::Tensor& dy) {
  return {dy, {}};
}

}  // namespace fusible::ops

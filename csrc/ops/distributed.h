// Collectives over a torch.distributed process group for the tensor-parallel ops, through c10d's
// functional collectives (_c10d_functional::*: NCCL on GPUs, gloo on CPU; nothing of ours on the
// wire). Each *_start returns at once with the result's tensor; wait() blocks until the collective
// has written it, so a caller can compute meanwhile (the overlap of a parallel linear's backward).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace fusible::ops {

/// A process group as c10d's group registry names it (Python: `group.group_name`, C++:
/// c10d::register_process_group), with this process's size and rank in it.
struct ProcessGroupSpec {
  std::string name;
  int64_t size = 1;
  int64_t rank = 0;
};

/// Checks a spec (a name, 1 <= size, 0 <= rank < size, and where c10d has registered the group,
/// its size and this process's rank); `op` names the op in the error.
void check_process_group(const char* op, const ProcessGroupSpec& group);

/// Gathers x from every rank along dim 0 (rank order): [size * x.size(0), ...].
at::Tensor all_gather_start(const char* op, const at::Tensor& x, const ProcessGroupSpec& group);
/// Sums x over the ranks and keeps this rank's slice of dim 0 (which the group size must divide).
at::Tensor reduce_scatter_start(const char* op, const at::Tensor& x, const ProcessGroupSpec& group);
/// Sums x over the ranks (`reduce` "sum"), or takes their elementwise "max".
at::Tensor all_reduce_start(const char* op, const at::Tensor& x, const ProcessGroupSpec& group,
                            const char* reduce = "sum");
/// The collective's result, once written.
at::Tensor wait(const at::Tensor& started);

}  // namespace fusible::ops

// Collectives through the dispatcher's _c10d_functional ops (registered by libtorch itself).
#include "ops/distributed.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/checks.h"

namespace fusible::ops {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> c10d_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using CT = const at::Tensor&;

}  // namespace

void check_process_group(const char* op, const ProcessGroupSpec& group) {
  TORCH_CHECK_VALUE(!group.name.empty(), op, ": expected a process group, got none");
  TORCH_CHECK_VALUE(group.size >= 1 && group.rank >= 0 && group.rank < group.size, op,
                    ": expected 0 <= rank < size, got rank ", group.rank, " of ", group.size);
  // Where c10d knows the group, the spec must say what it is: a size left at its default of 1
  // would turn the op's parallelism off without a word. (A name c10d does not know yet is
  // checked by the first collective.)
  c10::intrusive_ptr<c10d::ProcessGroup> registered;
  try {
    registered = c10d::resolve_process_group(group.name);
  } catch (const c10::Error&) {
    return;
  }
  if (!registered) return;
  TORCH_CHECK_VALUE(registered->getSize() == group.size && registered->getRank() == group.rank, op,
                    ": process group '", group.name, "' has ", registered->getSize(),
                    " ranks and this process is its rank ", registered->getRank(),
                    "; the ProcessGroupSpec says size ", group.size, ", rank ", group.rank);
}

at::Tensor all_gather_start(const char* op, const at::Tensor& x, const ProcessGroupSpec& group) {
  FUSIBLE_CHECK_MIN_DIM(op, "input", x, 1);
  static const auto gather =
      c10d_op<at::Tensor(CT, int64_t, std::string)>("_c10d_functional::all_gather_into_tensor");
  return gather.call(x.contiguous(), group.size, group.name);
}

at::Tensor reduce_scatter_start(const char* op, const at::Tensor& x,
                                const ProcessGroupSpec& group) {
  FUSIBLE_CHECK_MIN_DIM(op, "input", x, 1);
  TORCH_CHECK(x.size(0) % group.size == 0, op, ": expected a dim 0 (", x.size(0),
              ") divisible by the process group's size (", group.size,
              ") to scatter it over the ranks (input shape ", shape_str(x), ")");
  static const auto scatter = c10d_op<at::Tensor(CT, std::string, int64_t, std::string)>(
      "_c10d_functional::reduce_scatter_tensor");
  return scatter.call(x.contiguous(), "sum", group.size, group.name);
}

at::Tensor all_reduce_start(const char*, const at::Tensor& x, const ProcessGroupSpec& group,
                            const char* reduce) {
  static const auto all_reduce =
      c10d_op<at::Tensor(CT, std::string, std::string)>("_c10d_functional::all_reduce");
  return all_reduce.call(x.contiguous(), reduce, group.name);
}

at::Tensor wait(const at::Tensor& started) {
  static const auto wait_op = c10d_op<at::Tensor(CT)>("_c10d_functional::wait_tensor");
  return wait_op.call(started);
}

}  // namespace fusible::ops

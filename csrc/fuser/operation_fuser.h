// OperationFuser: owns a flat list of basic ops, plans forward and backward fusions, and runs the
// whole list forward and backward inside one autograd node (DESIGN.md section 3).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <string>
#include <vector>

#include "ops/fusible_operation.h"
#include "ops/fusion_registry.h"

namespace fusible::fuser {

/// One entry of a plan: the op that runs and the basic-op indices it covers (contiguous).
struct PlannedOp {
  std::shared_ptr<ops::FusibleOperation> op;
  std::vector<int64_t> basic_indices;
};

/// A forward plan and a backward plan (both in forward order; backward runs in reverse).
struct Plan {
  std::vector<PlannedOp> forward;
  std::vector<PlannedOp> backward;
};

struct FuserCall;

class OperationFuser {
 public:
  /// Flattens `ops` (composites expand into their basic ops).
  explicit OperationFuser(std::vector<std::shared_ptr<ops::FusibleOperation>> ops);

  /// Runs the ops: returns [y, public extra outputs in (op, slot) order].
  std::vector<at::Tensor> forward(const at::Tensor& input,
                                  const std::vector<at::Tensor>& extra_inputs);

  int64_t num_extra_inputs() const { return num_public_extra_inputs_; }
  int64_t num_extra_outputs() const { return num_public_extra_outputs_; }
  const std::vector<std::shared_ptr<ops::BasicOperation>>& basic_ops() const { return basic_ops_; }
  const std::vector<std::shared_ptr<ops::FusibleOperation>>& top_level_ops() const { return ops_; }
  /// The plan of the most recent forward (null before the first).
  std::shared_ptr<const Plan> plan() const { return plan_; }
  /// Type names of the most recent plan: {forward names, backward names}.
  std::pair<std::vector<std::string>, std::vector<std::string>> fusion_plan() const;

  /// Builds (or returns the cached) plan for a first-backward index; exposed for tests.
  std::shared_ptr<const Plan> plan_for(int64_t first_backward);

 private:
  friend struct FuserAutograd;

  int64_t first_backward_index(const at::Tensor& input,
                               const std::vector<at::Tensor>& extra_inputs) const;
  void refresh_parameter_cache();
  c10::intrusive_ptr<FuserCall> make_call(const at::Tensor& input,
                                       const std::vector<at::Tensor>& extra_inputs,
                                       int64_t first_backward);

  std::vector<std::shared_ptr<ops::FusibleOperation>> ops_;
  std::vector<std::shared_ptr<ops::BasicOperation>> basic_ops_;
  // Per basic op: its public extra-input / extra-output positions (one per slot).
  std::vector<std::vector<int64_t>> extra_input_pos_;
  std::vector<std::vector<int64_t>> extra_output_pos_;
  bool first_forward_done_ = false;
  int64_t num_public_extra_inputs_ = 0;
  int64_t num_public_extra_outputs_ = 0;

  // Parameter cache: flat list, and per basic op its positions in it.
  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> param_pos_;
  int64_t param_generation_ = 0;

  // Plan cache key and plan.
  std::shared_ptr<const Plan> plan_;
  int64_t plan_first_backward_ = -1;
  int64_t plan_registry_version_ = -1;
  int64_t plan_param_generation_ = -1;
};

}  // namespace fusible::fuser

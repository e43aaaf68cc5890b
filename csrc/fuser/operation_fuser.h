// OperationFuser: owns a flat list of basic ops, plans forward and backward fusions, and runs the
// whole list forward and backward inside one autograd node.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fuser/channel_routing.h"
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

/// Where each basic op's parameters sit in a call's flat parameter list (basic-op order, each op's
/// in op_parameters() order). Immutable and shared by every call made with it.
struct ParamLayout {
  std::vector<std::vector<int64_t>> pos;  // per basic op: positions in the flat list
  int64_t size = 0;
};

/// How a fuser takes part in a larger model.
struct FuserOptions {
  /// A persistent fuser (user-held, or a Sequential's group) locks its ops' channel routing while
  /// alive; the throw-away fuser of a plain op(x) call does not, and re-routes after a change.
  bool lock_channels = true;
  /// Channels fed by name from outside (earlier groups of a Sequential, or the caller).
  std::set<std::string> external_inputs;
  /// Hidden named outputs that later groups consume: exported as extra autograd outputs.
  std::set<std::string> export_channels;
};

/// "who: expected N extra inputs, got M; in order they feed <takers>" (and how to feed them).
std::string extra_input_error(const char* who, const std::vector<std::string>& takers, size_t got);

class OperationFuser {
 public:
  /// Flattens `ops` (composites expand into their basic ops) and checks channel wiring.
  explicit OperationFuser(std::vector<std::shared_ptr<ops::FusibleOperation>> ops,
                          FuserOptions options = {});
  ~OperationFuser();
  OperationFuser(const OperationFuser&) = delete;
  OperationFuser& operator=(const OperationFuser&) = delete;

  /// Runs the ops: returns [y, exported extra outputs in (op, slot) order] (see exported()).
  /// named_inputs feeds the external channels, by name. `params` are the parameters the call
  /// computes with and differentiates (parameter_layout() order); without them, the ops'
  /// registered parameters.
  std::vector<at::Tensor> forward(
      const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
      const std::vector<std::pair<std::string, at::Tensor>>& named_inputs = {},
      std::optional<at::TensorList> params = std::nullopt);
  /// forward without its own ops::Fp8StateRollback, for a caller whose rollback already covers
  /// these ops and sees every exception of the call (Sequential::run's loop).
  std::vector<at::Tensor> forward_covered(
      const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
      const std::vector<std::pair<std::string, at::Tensor>>& named_inputs,
      std::optional<at::TensorList> params);
  /// How a call's flat parameter list maps to the basic ops.
  const ParamLayout& parameter_layout() const { return *param_layout_; }

  int64_t num_extra_inputs() const { return routing_->num_public_inputs; }
  /// Who takes each extra input, by position: "<op type> (extra input <slot>)", for errors.
  std::vector<std::string> extra_input_takers() const;
  /// Number of public extra outputs.
  int64_t num_extra_outputs() const;
  /// What each exported output is: public (returned to the caller) and/or named.
  const std::vector<ExportedOutput>& exported() const { return routing_->exported; }
  /// Names of the channels this fuser takes from outside.
  const std::vector<std::string>& external_inputs() const { return routing_->external_inputs; }
  const Routing& routing() const { return *routing_; }
  const std::vector<std::shared_ptr<ops::BasicOperation>>& basic_ops() const { return basic_ops_; }
  /// The plan of the most recent forward (null before the first).
  std::shared_ptr<const Plan> plan() const {
    const std::lock_guard<std::mutex> lock(plan_mutex_);
    return plan_;
  }
  /// Type names of the most recent plan: {forward names, backward names}.
  std::pair<std::vector<std::string>, std::vector<std::string>> fusion_plan() const;

 private:
  std::shared_ptr<const Plan> plan_for(int64_t first_backward,
                                       const std::vector<at::ScalarType>& param_dtypes);
  std::vector<at::Tensor> registered_parameters();
  void prepare_parameters(const at::Tensor& input, at::TensorList params, bool from_caller);
  int64_t first_backward_index(const at::Tensor& input, at::TensorList params,
                               const std::vector<at::Tensor>& extra_inputs,
                               const std::vector<at::Tensor>& external) const;
  c10::intrusive_ptr<FuserCall> make_call(const at::Tensor& input, at::TensorList params,
                                          const std::vector<at::Tensor>& extra_inputs,
                                          const std::vector<at::Tensor>& external,
                                          int64_t first_backward);

  int64_t routing_version_sum() const;
  void reroute_if_changed();

  std::vector<std::shared_ptr<ops::FusibleOperation>> ops_;
  std::vector<std::shared_ptr<ops::BasicOperation>> basic_ops_;
  FuserOptions options_;
  std::shared_ptr<const Routing> routing_;
  int64_t routing_version_ = 0;

  std::shared_ptr<const ParamLayout> param_layout_;

  // Plan cache key and plan: ops, grad, registry and the call's parameter dtypes (fusion
  // preconditions), never parameter values or devices.
  // Calls from Python run without the GIL: two threads may plan one fuser at once.
  mutable std::mutex plan_mutex_;
  std::shared_ptr<const Plan> plan_;
  int64_t plan_first_backward_ = -1;
  int64_t plan_registry_version_ = -1;
  std::vector<at::ScalarType> plan_param_dtypes_;
  std::string plan_recipe_;             // the FP8 recipe kind the plan was made under ("" when off)
  std::vector<int64_t> plan_settings_;  // the ops' plan_settings() it was made with
};

}  // namespace fusible::fuser

// Sequential for C++ programs: an ordered list of fusible ops (and plain tensor functions) whose
// consecutive fusible ops run as one OperationFuser each.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fuser/operation_fuser.h"

namespace fusible::fuser {

/// One group of a plan: a fuser group's forward/backward op names, or a plain module's name.
struct GroupPlan {
  std::string module;  // non-empty for a non-fusible entry
  std::vector<std::string> forward;
  std::vector<std::string> backward;
};

class Sequential : public torch::nn::Module {
 public:
  using TensorFn = std::function<at::Tensor(const at::Tensor&)>;

  Sequential() : torch::nn::Module("Sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<ops::FusibleOperation>> ops);

  /// Appends a fusible op (registered as submodule "<index>").
  void push_back(std::shared_ptr<ops::FusibleOperation> op);
  /// Appends a non-fusible step, run between fuser groups.
  void push_back(TensorFn fn, std::string name);
  size_t size() const { return entries_.size(); }

  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
  struct Outputs {
    std::vector<at::Tensor> outputs;  // [y, public extra outputs in op order]
    NamedTensors named;               // every public named output
  };

  /// Runs the groups in order. Extra inputs are consumed by the groups in op order; channels
  /// connect ops across groups; named_inputs feed bound inputs that have no producer inside.
  Outputs run(const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
              const NamedTensors& named_inputs);
  /// run(...).outputs without named inputs.
  std::vector<at::Tensor> forward(const at::Tensor& input,
                                  const std::vector<at::Tensor>& extra_inputs = {}) {
    return run(input, extra_inputs, {}).outputs;
  }
  /// The plan of the most recent forward, one entry per group.
  std::vector<GroupPlan> fusion_plan() const;
  /// Re-initializes every op's parameters.
  void reset_parameters();

 private:
  struct Entry {
    std::shared_ptr<ops::FusibleOperation> op;  // null for a plain step
    TensorFn fn;
    std::string name;
  };
  struct Group {
    std::shared_ptr<OperationFuser> fuser;  // null for a plain step
    const Entry* step = nullptr;
  };
  void build_groups(const std::set<std::string>& named_inputs);
  void invalidate_groups();

  std::vector<Entry> entries_;
  std::vector<Group> groups_;
  bool groups_valid_ = false;
  std::set<std::string> groups_named_inputs_;  // the named inputs the groups were wired for
};

}  // namespace fusible::fuser

// Sequential for C++ programs: an ordered list of fusible ops (and plain tensor functions) whose
// consecutive fusible ops run as one OperationFuser each.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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
  /// Runs one fuser group: (x, its extra inputs, its parameters or nullopt for those the
  /// Sequential was given) -> [y, exported outputs] (OperationFuser::forward). Holds what it
  /// needs by value: a binding may keep it.
  using GroupRunner =
      std::function<std::vector<at::Tensor>(const at::Tensor&, const std::vector<at::Tensor>&,
                                            const std::optional<std::vector<at::Tensor>>&)>;
  /// Called instead of an isolated op's group: (entry index, x, extra inputs, the group's runner)
  /// -> what the runner returns, possibly changed (a binding runs the op's forward hooks here).
  using AroundFn = std::function<std::vector<at::Tensor>(
      size_t, const at::Tensor&, const std::vector<at::Tensor>&, const GroupRunner&)>;

  Sequential() : torch::nn::Module("Sequential") {}
  explicit Sequential(std::vector<std::shared_ptr<ops::FusibleOperation>> ops);

  /// Appends a fusible op (registered as submodule "<index>").
  void push_back(std::shared_ptr<ops::FusibleOperation> op);
  /// Appends a non-fusible step, run between fuser groups.
  void push_back(TensorFn fn, std::string name);
  size_t size() const;

  using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
  struct Outputs {
    std::vector<at::Tensor> outputs;  // [y, public extra outputs in op order]
    NamedTensors named;               // every public named output
  };

  /// Runs the groups in order. Extra inputs are consumed by the groups in op order; channels
  /// connect ops across groups; named_inputs feed bound inputs that have no producer inside (a
  /// name that feeds none is a ValueError). `params`: the parameters of every fusible op, in
  /// entry order (each op's as its fuser takes them); without them, the ops' registered ones.
  /// `around` runs isolated ops' groups (see set_isolated).
  Outputs run(const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
              const NamedTensors& named_inputs,
              const std::optional<std::vector<at::Tensor>>& params = std::nullopt,
              const AroundFn& around = nullptr);
  /// run(...).outputs without named inputs.
  std::vector<at::Tensor> forward(const at::Tensor& input,
                                  const std::vector<at::Tensor>& extra_inputs = {}) {
    return run(input, extra_inputs, {}).outputs;
  }
  /// The plan of the most recent forward, one entry per group.
  std::vector<GroupPlan> fusion_plan() const;
  /// Per entry: whether that fusible op runs alone, as its own group (a hooked op stays
  /// unfused). Regroups only when a flag changes.
  void set_isolated(const std::vector<bool>& flags);
  /// One per group: its fuser and the entry index of its first op (a plain step: null and its
  /// entry index). Built on demand for the given named inputs.
  std::vector<std::pair<std::shared_ptr<OperationFuser>, size_t>> groups(
      const std::set<std::string>& named_inputs = {});
  /// A deep copy: copies of the ops (own parameters, same channels), the same plain steps.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override;
  /// Re-initializes every op's parameters.
  void reset_parameters();

 private:
  struct Entry {
    std::shared_ptr<ops::FusibleOperation> op;  // null for a plain step
    TensorFn fn;
    std::string name;  // a plain step's name, or the op's submodule name
    bool isolated = false;
  };
  struct Group {
    std::shared_ptr<OperationFuser> fuser;  // null for a plain step
    size_t entry = 0;                       // index of its (first) entry
    bool isolated = false;                  // an isolated op's group (runs through `around`)
    TensorFn fn;                            // a plain step's function and name
    std::string name;
  };
  /// One grouping, never changed once built: a call runs the grouping it started with to its
  /// end, while another thread may replace it (calls run without the GIL).
  struct Grouping {
    std::vector<Group> groups;
    std::set<std::string> named_inputs;    // the named inputs the groups were wired for
    std::set<std::string> consumed_names;  // channels the groups take from outside
  };
  /// The current grouping for these named inputs, built if needed.
  std::shared_ptr<const Grouping> grouping(const std::set<std::string>& named_inputs);
  static std::shared_ptr<const Grouping> build_grouping(const std::vector<Entry>& entries,
                                                        const std::set<std::string>& named_inputs);
  void invalidate_groups() const;
  /// LibTorch's replace_module and unregister_module change the registered children only (they
  /// are not virtual): the entries follow them before a call, a copy, a reset or a size. With
  /// grouping_mutex_ held.
  void follow_children() const;

  // Mutable: they follow the registered children, also in const methods (follow_children).
  mutable std::vector<Entry> entries_;
  mutable std::mutex grouping_mutex_;                 // guards grouping_, generation_, entries_
  mutable std::shared_ptr<const Grouping> grouping_;  // null: built on the next call
  mutable int64_t generation_ = 0;                    // bumped by every change to the entries
};

}  // namespace fusible::fuser

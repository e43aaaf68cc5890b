// C++ Sequential: grouping and running.
#include "fuser/sequential.h"

#include <c10/util/Exception.h>

namespace fusible::fuser {

Sequential::Sequential(std::vector<std::shared_ptr<ops::FusibleOperation>> ops) : Sequential() {
  for (auto& op : ops) push_back(std::move(op));
}

void Sequential::push_back(std::shared_ptr<ops::FusibleOperation> op) {
  TORCH_CHECK_VALUE(op != nullptr, "Sequential: expected an op, got null");
  register_module(std::to_string(entries_.size()), op);
  entries_.push_back({std::move(op), nullptr, ""});
  invalidate_groups();
}

void Sequential::push_back(TensorFn fn, std::string name) {
  TORCH_CHECK_VALUE(fn != nullptr, "Sequential: expected a function, got null");
  entries_.push_back({nullptr, std::move(fn), std::move(name)});
  invalidate_groups();
}

void Sequential::invalidate_groups() {
  groups_.clear();  // drops the fusers: releases their channel locks now
  groups_valid_ = false;
}

void Sequential::build_groups(const std::set<std::string>& named_inputs) {
  invalidate_groups();  // also when building fails below: never run stale groups
  // Consecutive fusible ops form one group; plain steps stand alone.
  std::vector<std::vector<std::shared_ptr<ops::FusibleOperation>>> runs;
  std::vector<const Entry*> steps;  // per group: the plain step, or null
  bool in_run = false;
  for (const auto& e : entries_) {
    if (e.op) {
      if (!in_run) {
        runs.emplace_back();
        steps.push_back(nullptr);
      }
      runs.back().push_back(e.op);
      in_run = true;
    } else {
      runs.emplace_back();
      steps.push_back(&e);
      in_run = false;
    }
  }
  std::vector<std::vector<std::shared_ptr<ops::BasicOperation>>> basic(runs.size());
  for (size_t g = 0; g < runs.size(); ++g) {
    for (const auto& op : runs[g]) {
      for (auto& b : op->basic_ops()) basic[g].push_back(b);
    }
  }
  const auto channels = plan_group_channels(basic, named_inputs);
  std::vector<Group> groups;
  for (size_t g = 0; g < runs.size(); ++g) {
    if (steps[g]) {
      groups.push_back({nullptr, steps[g]});
      continue;
    }
    FuserOptions options;
    options.external_inputs = channels[g].external_inputs;
    options.export_channels = channels[g].export_channels;
    groups.push_back({std::make_shared<OperationFuser>(runs[g], std::move(options)), nullptr});
  }
  groups_ = std::move(groups);
  groups_valid_ = true;
  groups_named_inputs_ = named_inputs;
}

Sequential::Outputs Sequential::run(const at::Tensor& input,
                                    const std::vector<at::Tensor>& extra_inputs,
                                    const NamedTensors& named_inputs) {
  std::set<std::string> names;
  for (const auto& [name, t] : named_inputs) names.insert(name);
  if (!groups_valid_ || names != groups_named_inputs_) build_groups(names);
  int64_t needed = 0;
  for (const auto& g : groups_) needed += g.fuser ? g.fuser->num_extra_inputs() : 0;
  TORCH_CHECK_VALUE(static_cast<int64_t>(extra_inputs.size()) == needed, "Sequential: expected ",
                    needed, " extra inputs, got ", extra_inputs.size());
  at::Tensor x = input;
  Outputs result;
  result.outputs.emplace_back();
  NamedTensors channels = named_inputs;  // tensors by channel name, as groups produce them
  size_t next_extra = 0;
  for (const auto& g : groups_) {
    if (!g.fuser) {
      x = g.step->fn(x);
      continue;
    }
    const auto k = g.fuser->num_extra_inputs();
    std::vector<at::Tensor> extras(extra_inputs.begin() + next_extra,
                                   extra_inputs.begin() + next_extra + k);
    next_extra += k;
    auto out = g.fuser->forward(x, extras, channels);
    x = out[0];
    const auto& exported = g.fuser->exported();
    for (size_t i = 0; i < exported.size(); ++i) {
      if (exported[i].is_public) result.outputs.push_back(out[i + 1]);
      if (!exported[i].name.empty()) channels.emplace_back(exported[i].name, out[i + 1]);
      if (exported[i].is_public && !exported[i].name.empty()) {
        result.named.emplace_back(exported[i].name, out[i + 1]);
      }
    }
  }
  result.outputs[0] = x;
  return result;
}

std::vector<GroupPlan> Sequential::fusion_plan() const {
  std::vector<GroupPlan> out;
  for (const auto& g : groups_) {
    if (!g.fuser) {
      out.push_back({g.step->name, {}, {}});
      continue;
    }
    auto [f, b] = g.fuser->fusion_plan();
    out.push_back({"", std::move(f), std::move(b)});
  }
  return out;
}

void Sequential::reset_parameters() {
  for (auto& e : entries_) {
    if (e.op) e.op->reset_parameters();
  }
}

}  // namespace fusible::fuser

// C++ Sequential: grouping and running (also the engine behind Python's ops.Sequential).
#include "fuser/sequential.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

#include "ops/fp8_state_rollback.h"

namespace fusible::fuser {

Sequential::Sequential(std::vector<std::shared_ptr<ops::FusibleOperation>> ops) : Sequential() {
  for (auto& op : ops) push_back(std::move(op));
}

void Sequential::push_back(std::shared_ptr<ops::FusibleOperation> op) {
  TORCH_CHECK_VALUE(op != nullptr, "Sequential: expected an op, got null");
  const std::lock_guard lock(grouping_mutex_);
  follow_children();
  auto name = std::to_string(entries_.size());
  while (named_children().contains(name)) name += "_";  // a name left by unregister_module
  register_module(name, op);
  entries_.push_back({std::move(op), nullptr, std::move(name)});
  invalidate_groups();
}

size_t Sequential::size() const {
  const std::lock_guard lock(grouping_mutex_);
  follow_children();
  return entries_.size();
}

void Sequential::follow_children() const {
  // The common case, nothing changed: the children are the entries' ops, in order.
  const auto children = this->children();
  size_t k = 0;
  bool same = true;
  for (const auto& e : entries_) {
    if (!e.op) continue;
    same = k < children.size() && children[k].get() == e.op.get();
    if (!same) break;
    ++k;
  }
  if (same && k == children.size()) return;
  const auto named = named_children();
  std::vector<Entry> entries;  // copies: a refusal below leaves the entries as they were
  for (const auto& e : entries_) {
    if (!e.op) {
      entries.push_back(e);
      continue;
    }
    const auto* child = named.find(e.name);
    if (child == nullptr) continue;  // unregistered
    auto op = std::dynamic_pointer_cast<ops::FusibleOperation>(*child);
    TORCH_CHECK_TYPE(op != nullptr, "Sequential: submodule '", e.name, "' was replaced by a ",
                     (*child)->name(), ", which is not a fusible op (push a function instead)");
    entries.push_back(e);
    entries.back().op = std::move(op);
  }
  // An extra submodule, or a child re-registered at the end, takes this path on every call:
  // regroup only when the entries changed.
  const bool changed =
      entries.size() != entries_.size() ||
      !std::equal(entries.begin(), entries.end(), entries_.begin(),
                  [](const Entry& a, const Entry& b) { return a.op == b.op && a.name == b.name; });
  if (!changed) return;
  entries_ = std::move(entries);
  invalidate_groups();
}

void Sequential::push_back(TensorFn fn, std::string name) {
  TORCH_CHECK_VALUE(fn != nullptr, "Sequential: expected a function, got null");
  const std::lock_guard lock(grouping_mutex_);
  entries_.push_back({nullptr, std::move(fn), std::move(name)});
  invalidate_groups();
}

void Sequential::set_isolated(const std::vector<bool>& flags) {
  const std::lock_guard lock(grouping_mutex_);
  follow_children();
  TORCH_CHECK_VALUE(flags.size() == entries_.size(), "Sequential: expected ", entries_.size(),
                    " isolation flags, got ", flags.size());
  bool changed = false;
  for (size_t i = 0; i < flags.size(); ++i) {
    const bool isolated = flags[i] && entries_[i].op != nullptr;
    changed = changed || isolated != entries_[i].isolated;
    entries_[i].isolated = isolated;
  }
  if (changed) invalidate_groups();
}

void Sequential::invalidate_groups() const {  // with grouping_mutex_ held
  grouping_.reset();  // drops the fusers (and their channel locks) once no call runs them
  ++generation_;
}

std::shared_ptr<const Sequential::Grouping> Sequential::build_grouping(
    const std::vector<Entry>& entries, const std::set<std::string>& named_inputs) {
  // Consecutive fusible ops form one group; plain steps and isolated ops stand alone.
  std::vector<std::vector<std::shared_ptr<ops::FusibleOperation>>> runs;
  std::vector<size_t> first_entry;  // per group
  std::vector<bool> is_step;        // per group
  bool in_run = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (!e.op || e.isolated || !in_run) {
      runs.emplace_back();
      first_entry.push_back(i);
      is_step.push_back(!e.op);
    }
    if (e.op) runs.back().push_back(e.op);
    in_run = e.op && !e.isolated;
  }
  std::vector<std::vector<std::shared_ptr<ops::BasicOperation>>> basic(runs.size());
  for (size_t g = 0; g < runs.size(); ++g) {
    for (const auto& op : runs[g]) {
      for (auto& b : op->basic_ops()) basic[g].push_back(b);
    }
  }
  const auto channels = plan_group_channels(basic, named_inputs);
  auto grouping = std::make_shared<Grouping>();
  for (size_t g = 0; g < runs.size(); ++g) {
    const auto entry = first_entry[g];
    if (is_step[g]) {
      grouping->groups.push_back({nullptr, entry, false, entries[entry].fn, entries[entry].name});
      continue;
    }
    FuserOptions options;
    options.external_inputs = channels[g].external_inputs;
    options.export_channels = channels[g].export_channels;
    // A name made by an earlier group is not the caller's to feed: channel_inputs naming it are
    // refused below, as in a model of one group.
    grouping->consumed_names.insert(channels[g].caller_inputs.begin(),
                                    channels[g].caller_inputs.end());
    grouping->groups.push_back({std::make_shared<OperationFuser>(runs[g], std::move(options)),
                                entry, entries[entry].isolated});
  }
  grouping->named_inputs = named_inputs;
  return grouping;
}

std::shared_ptr<const Sequential::Grouping> Sequential::grouping(
    const std::set<std::string>& named_inputs) {
  std::vector<Entry> entries;
  int64_t generation = 0;
  {
    const std::lock_guard lock(grouping_mutex_);
    follow_children();
    if (grouping_ && grouping_->named_inputs == named_inputs) return grouping_;
    grouping_.reset();  // never kept for other inputs: a failed build below leaves no grouping
    entries = entries_;
    generation = generation_;
  }
  // Built without the lock: an op's basic_ops() may call back into Python, which may wait for
  // the GIL that a thread calling set_isolated holds. A failed build leaves nothing behind.
  auto built = build_grouping(entries, named_inputs);
  const std::lock_guard lock(grouping_mutex_);
  if (generation == generation_) grouping_ = built;  // else: the entries changed meanwhile
  return built;
}

std::vector<std::pair<std::shared_ptr<OperationFuser>, size_t>> Sequential::groups(
    const std::set<std::string>& named_inputs) {
  std::vector<std::pair<std::shared_ptr<OperationFuser>, size_t>> out;
  for (const auto& g : grouping(named_inputs)->groups) out.emplace_back(g.fuser, g.entry);
  return out;
}

Sequential::Outputs Sequential::run(const at::Tensor& input,
                                    const std::vector<at::Tensor>& extra_inputs,
                                    const NamedTensors& named_inputs,
                                    const std::optional<std::vector<at::Tensor>>& params,
                                    const AroundFn& around) {
  std::set<std::string> names;
  for (const auto& [name, t] : named_inputs) names.insert(name);
  const auto current = grouping(names);  // kept for the whole call
  const auto& groups = current->groups;
  std::vector<std::string> unused;
  for (const auto& name : names) {
    if (!current->consumed_names.count(name)) unused.push_back(name);
  }
  TORCH_CHECK_VALUE(unused.empty(), "Sequential: channel_inputs ", c10::Join(", ", unused),
                    " feed no bound input that lacks a producer inside the model");
  int64_t needed = 0, num_params = 0;
  for (const auto& g : groups) {
    if (!g.fuser) continue;
    needed += g.fuser->num_extra_inputs();
    num_params += g.fuser->parameter_layout().size;
  }
  if (static_cast<int64_t>(extra_inputs.size()) != needed) {
    std::vector<std::string> takers;
    for (const auto& g : groups) {
      if (!g.fuser) continue;
      for (auto& t : g.fuser->extra_input_takers()) {
        takers.push_back(std::move(t) + " in the group from entry " + std::to_string(g.entry));
      }
    }
    TORCH_CHECK_VALUE(false, extra_input_error("Sequential", takers, extra_inputs.size()));
  }
  TORCH_CHECK_VALUE(!params || static_cast<int64_t>(params->size()) == num_params,
                    "Sequential: expected ", num_params, " parameters, got ", params->size());
  // A group (or a plain step) that raises puts back the delayed-scaling updates of every cast
  // the call made, in earlier groups too.
  std::vector<std::shared_ptr<ops::BasicOperation>> basic_ops;
  if (ops::Fp8StateRollback::needed()) {  // gathered only where the guard will act
    for (const auto& g : groups) {
      if (!g.fuser) continue;
      const auto& more = g.fuser->basic_ops();
      basic_ops.insert(basic_ops.end(), more.begin(), more.end());
    }
  }
  ops::Fp8StateRollback rollback(basic_ops);
  at::Tensor x = input;
  Outputs result;
  result.outputs.emplace_back();
  NamedTensors channels = named_inputs;  // tensors by channel name, as groups produce them
  size_t next_extra = 0, next_param = 0;
  for (const auto& g : groups) {
    if (!g.fuser) {
      x = g.fn(x);
      continue;
    }
    const auto k = g.fuser->num_extra_inputs();
    std::vector<at::Tensor> extras(extra_inputs.begin() + next_extra,
                                   extra_inputs.begin() + next_extra + k);
    next_extra += k;
    std::optional<at::TensorList> group_params;
    if (params) {
      const auto n = g.fuser->parameter_layout().size;
      group_params = at::TensorList(*params).slice(next_param, n);
      next_param += n;
    }
    std::vector<at::Tensor> out;
    if (g.isolated && around) {
      // By value: a binding may keep the runner past this call.
      std::optional<std::vector<at::Tensor>> own_params;
      if (group_params) own_params = group_params->vec();
      const GroupRunner run_group = [fuser = g.fuser, channels, own_params](
                                        const at::Tensor& in, const std::vector<at::Tensor>& ex,
                                        const std::optional<std::vector<at::Tensor>>& p) {
        const auto& use = p ? p : own_params;
        return fuser->forward(in, ex, channels,
                              use ? std::optional<at::TensorList>(*use) : std::nullopt);
      };
      out = around(g.entry, x, extras, run_group);
    } else {  // this call's rollback covers the group and sees its every exception
      out = g.fuser->forward_covered(x, extras, channels, group_params);
    }
    const auto& exported = g.fuser->exported();
    TORCH_CHECK(out.size() == exported.size() + 1, "Sequential: group at entry ", g.entry,
                " returned ", out.size(), " tensors, expected ", exported.size() + 1);
    x = out[0];
    for (size_t i = 0; i < exported.size(); ++i) {
      if (exported[i].is_public) result.outputs.push_back(out[i + 1]);
      if (!exported[i].name.empty()) channels.emplace_back(exported[i].name, out[i + 1]);
      if (exported[i].is_public && !exported[i].name.empty()) {
        result.named.emplace_back(exported[i].name, out[i + 1]);
      }
    }
  }
  result.outputs[0] = x;
  rollback.commit();
  return result;
}

std::vector<GroupPlan> Sequential::fusion_plan() const {
  std::shared_ptr<const Grouping> current;
  {
    const std::lock_guard lock(grouping_mutex_);
    current = grouping_;
  }
  std::vector<GroupPlan> out;
  if (!current) return out;
  for (const auto& g : current->groups) {
    if (!g.fuser) {
      out.push_back({g.name, {}, {}});
      continue;
    }
    auto [f, b] = g.fuser->fusion_plan();
    out.push_back({"", std::move(f), std::move(b)});
  }
  return out;
}

std::shared_ptr<torch::nn::Module> Sequential::clone(
    const std::optional<c10::Device>& device) const {
  auto copy = std::make_shared<Sequential>();
  std::vector<Entry> entries;
  {
    const std::lock_guard lock(grouping_mutex_);
    follow_children();
    entries = entries_;
  }
  for (const auto& e : entries) {
    if (e.op) {
      copy->push_back(std::dynamic_pointer_cast<ops::FusibleOperation>(e.op->clone(device)));
    } else {
      copy->push_back(e.fn, e.name);
    }
  }
  return copy;
}

void Sequential::reset_parameters() {
  std::vector<Entry> entries;
  {
    const std::lock_guard lock(grouping_mutex_);
    follow_children();
    entries = entries_;
  }
  for (auto& e : entries) {
    if (e.op) e.op->reset_parameters();
  }
}

}  // namespace fusible::fuser

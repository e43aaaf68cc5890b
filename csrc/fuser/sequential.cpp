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
  groups_valid_ = false;
}

void Sequential::push_back(TensorFn fn, std::string name) {
  TORCH_CHECK_VALUE(fn != nullptr, "Sequential: expected a function, got null");
  entries_.push_back({nullptr, std::move(fn), std::move(name)});
  groups_valid_ = false;
}

void Sequential::build_groups() {
  groups_.clear();
  std::vector<std::shared_ptr<ops::FusibleOperation>> run;
  auto flush = [&] {
    if (!run.empty()) groups_.push_back({std::make_shared<OperationFuser>(std::move(run)), nullptr});
    run.clear();
  };
  for (const auto& e : entries_) {
    if (e.op) {
      run.push_back(e.op);
    } else {
      flush();
      groups_.push_back({nullptr, &e});
    }
  }
  flush();
  groups_valid_ = true;
}

std::vector<at::Tensor> Sequential::forward(const at::Tensor& input,
                                            const std::vector<at::Tensor>& extra_inputs) {
  if (!groups_valid_) build_groups();
  int64_t needed = 0;
  for (const auto& g : groups_) needed += g.fuser ? g.fuser->num_extra_inputs() : 0;
  TORCH_CHECK_VALUE(static_cast<int64_t>(extra_inputs.size()) == needed, "Sequential: expected ",
                    needed, " extra inputs, got ", extra_inputs.size());
  at::Tensor x = input;
  std::vector<at::Tensor> extra_outputs;
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
    auto out = g.fuser->forward(x, extras);
    x = out[0];
    extra_outputs.insert(extra_outputs.end(), out.begin() + 1, out.end());
  }
  std::vector<at::Tensor> result{x};
  result.insert(result.end(), extra_outputs.begin(), extra_outputs.end());
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

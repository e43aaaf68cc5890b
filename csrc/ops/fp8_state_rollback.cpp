#include "ops/fp8_state_rollback.h"

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <unordered_set>

#include "ops/amax_reduction.h"
#include "ops/fusible_operation.h"

namespace fusible::ops {

namespace {
std::atomic<bool> rollback_on{true};
// This thread's active guards, innermost last, and the ops they hold.
thread_local std::vector<Fp8StateRollback*> active_guards;
thread_local std::unordered_set<const BasicOperation*> held_ops;
}  // namespace

bool Fp8StateRollback::enabled() { return rollback_on.load(std::memory_order_relaxed); }
void Fp8StateRollback::set_enabled(bool on) { rollback_on.store(on, std::memory_order_relaxed); }

bool Fp8StateRollback::needed() {
  const auto& a = fp8_autocast();
  return a.enabled && a.recipe && a.recipe->kind == "delayed" && enabled();
}

Fp8StateRollback::Fp8StateRollback(const std::vector<std::shared_ptr<BasicOperation>>& ops) {
  if (!needed()) return;
  const auto& recipe = *fp8_autocast().recipe;
  Snapshot snap;
  for (const auto& op : ops) {
    bool seen = held_ops.count(op.get()) > 0;  // an outer guard holds it, or it sits here twice
    for (const auto& s : snap.saved) seen = seen || s.op == op;
    if (seen || op->num_quantizers() == std::pair<int64_t, int64_t>{0, 0}) continue;
    const auto& state = op->fp8_state();
    snap.saved.push_back({op, state, state ? *state : Fp8OpState{}, op->fp8_recipe()});
    if (!state) continue;
    for (const auto* list : {&state->forward, &state->backward}) {
      for (const auto& d : *list) {
        snap.tensors.push_back(d.amax_history);
        snap.tensors.push_back(d.scale);
      }
      // Under an amax reduction the casts record into the period's buffers instead.
      for (auto& t : tracked_period_buffers(recipe, *list)) snap.tensors.push_back(std::move(t));
    }
  }
  if (!snap.tensors.empty()) snap.copy_values();  // may raise: nothing is held yet
  for (const auto& s : snap.saved) held_ops.insert(s.op.get());
  if (!snap.saved.empty()) snapshots_.push_back(std::move(snap));
  active_ = true;
  active_guards.push_back(this);
}

void Fp8StateRollback::Snapshot::copy_values() {
  const at::NoGradGuard no_grad;
  bool one_device = true;
  std::vector<at::Tensor> flat_list;  // histories, scales and period buffers are 1-D: no views
  flat_list.reserve(tensors.size());
  for (const auto& t : tensors) {
    one_device = one_device && t.device() == tensors[0].device();
    flat_list.push_back(t.dim() == 1 ? t : t.reshape({-1}));
  }
  if (one_device) {
    flat = at::cat(flat_list);  // this runs on every call under delayed scaling
  } else {
    for (const auto& t : tensors) clones.push_back(t.clone());  // the rare path
  }
}

void Fp8StateRollback::Snapshot::restore() const {
  const at::NoGradGuard no_grad;
  for (const auto& s : saved) {
    if (s.state) *s.state = s.handles;  // its own tensors back (a move or a resize replaces them)
    s.op->restore_fp8(s.state, s.recipe);
  }
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const auto n = t.numel();
    // An inference tensor (a state loaded under torch.inference_mode) is written inside it.
    const c10::InferenceMode mode(t.is_inference());
    t.copy_((flat.defined() ? flat.narrow(0, offset, n) : clones[i]).view(t.sizes()));
    offset += n;
  }
}

void Fp8StateRollback::release() {
  active_ = false;
  active_guards.pop_back();  // guards live in scopes: this is the innermost
  if (!active_guards.empty()) return;
  for (const auto& snap : snapshots_) {
    for (const auto& s : snap.saved) held_ops.erase(s.op.get());
  }
}

void Fp8StateRollback::commit() {
  if (!active_) return;
  release();
  if (active_guards.empty()) return;
  auto& outer = active_guards.back()->snapshots_;  // a later failure out there puts these back too
  for (auto& snap : snapshots_) outer.push_back(std::move(snap));
  snapshots_.clear();
}

Fp8StateRollback::~Fp8StateRollback() {
  if (!active_) return;
  for (auto it = snapshots_.rbegin(); it != snapshots_.rend(); ++it) {
    try {
      it->restore();
    } catch (const c10::Error& e) {
      TORCH_WARN("FP8 delayed scaling: could not put the state back after a failed call: ",
                 e.what_without_backtrace());
    } catch (const std::exception& e) {
      TORCH_WARN("FP8 delayed scaling: could not put the state back after a failed call: ",
                 e.what());
    }
  }
  // Put back: no guard holds them now (an outer one that fails too has nothing more to do).
  for (const auto& snap : snapshots_) {
    for (const auto& s : snap.saved) held_ops.erase(s.op.get());
  }
  active_ = false;
  active_guards.pop_back();
}

}  // namespace fusible::ops

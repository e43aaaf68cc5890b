#include "ops/fp8_state_rollback.h"

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <atomic>

#include "ops/amax_reduction.h"
#include "ops/fusible_operation.h"

namespace fusible::ops {

namespace {
std::atomic<bool> rollback_on{true};
thread_local std::vector<Fp8StateRollback*> active_guards;  // this thread's, innermost last

bool same_handles(const Fp8OpState& a, const Fp8OpState& b) {
  const auto same = [](const std::vector<DelayedScaling>& x, const std::vector<DelayedScaling>& y) {
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!x[i].amax_history.is_same(y[i].amax_history) || !x[i].scale.is_same(y[i].scale)) {
        return false;
      }
    }
    return true;
  };
  return same(a.forward, b.forward) && same(a.backward, b.backward) &&
         a.forward_format == b.forward_format && a.backward_format == b.backward_format;
}

void warn_not_restored(const char* what) {
  TORCH_WARN("FP8 delayed scaling: could not put the state back after a failed call: ", what);
}
}  // namespace

bool Fp8StateRollback::enabled() { return rollback_on.load(std::memory_order_relaxed); }
void Fp8StateRollback::set_enabled(bool on) { rollback_on.store(on, std::memory_order_relaxed); }

bool Fp8StateRollback::needed() {
  const auto& a = fp8_autocast();
  return a.enabled && a.recipe && a.recipe->kind == "delayed" && enabled();
}

Fp8StateRollback::Fp8StateRollback(const std::vector<std::shared_ptr<BasicOperation>>& ops) {
  if (!needed()) return;
  Snapshot snap;
  snap.recipe = fp8_autocast().recipe;
  snap.tracked = tracked_count(*snap.recipe);
  for (const auto& op : ops) {
    if (op->num_quantizers() == std::pair<int64_t, int64_t>{0, 0}) continue;
    bool seen = false;  // an op that sits twice in a model is saved once
    for (const auto& s : snap.saved) seen = seen || s.op == op;
    if (seen) continue;
    const auto& state = op->fp8_state();
    snap.saved.push_back({op, state, state ? *state : Fp8OpState{}, op->fp8_recipe()});
    if (!state) continue;
    for (const auto* list : {&state->forward, &state->backward}) {
      for (const auto& d : *list) {
        snap.tensors.push_back(d.amax_history);
        snap.tensors.push_back(d.scale);
      }
      // Under an amax reduction the casts record into the period's buffers instead.
      for (auto& t : tracked_period_buffers(*snap.recipe, *list)) {
        snap.tensors.push_back(std::move(t));
      }
    }
  }
  if (!snap.tensors.empty()) snap.copy_values();  // may raise: nothing is registered yet
  snapshots_.push_back(std::move(snap));
  active_guards.push_back(this);
  active_ = true;
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
    // Written only where the call replaced something (a move, a resize, a fresh state), so a
    // restore that changes nothing writes nothing another thread could be reading.
    if (s.state && !same_handles(*s.state, s.handles)) *s.state = s.handles;
    if (s.op->fp8_state() != s.state || s.op->fp8_recipe() != s.recipe) {
      s.op->restore_fp8(s.state, s.recipe);
    }
  }
  int64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const auto n = t.numel();
    try {  // one tensor that cannot be written leaves the others to be put back
      // An inference tensor (a state loaded under torch.inference_mode) is written inside it.
      const c10::InferenceMode mode(t.is_inference());
      t.copy_((flat.defined() ? flat.narrow(0, offset, n) : clones[i]).view(t.sizes()));
    } catch (const c10::Error& e) {
      warn_not_restored(e.what_without_backtrace());
    }
    offset += n;
  }
  untrack_after(*recipe, tracked);  // the tracking the failed call's first casts began
}

void Fp8StateRollback::commit() {
  if (!active_) return;
  active_ = false;
  TORCH_INTERNAL_ASSERT(!active_guards.empty() && active_guards.back() == this);
  active_guards.pop_back();
  if (active_guards.empty()) return;
  // A later failure of the call around this one puts these ops back too.
  auto& outer = active_guards.back()->snapshots_;
  for (auto& snap : snapshots_) outer.push_back(std::move(snap));
  snapshots_.clear();
}

Fp8StateRollback::~Fp8StateRollback() {
  if (!active_) return;
  if (!active_guards.empty() && active_guards.back() == this) active_guards.pop_back();
  // Latest first: the guard's own snapshot, the earliest, decides.
  for (auto it = snapshots_.rbegin(); it != snapshots_.rend(); ++it) {
    try {
      it->restore();
    } catch (const c10::Error& e) {
      warn_not_restored(e.what_without_backtrace());
    } catch (const std::exception& e) {
      warn_not_restored(e.what());
    }
  }
}

}  // namespace fusible::ops

#include "ops/fp8_state_rollback.h"

#include <ATen/ops/cat.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <atomic>

#include "ops/fusible_operation.h"

namespace fusible::ops {

namespace {
thread_local int active_guards = 0;  // Fp8StateRollbacks doing the work on this thread
std::atomic<bool> rollback_on{true};
}  // namespace

bool Fp8StateRollback::enabled() { return rollback_on.load(std::memory_order_relaxed); }
void Fp8StateRollback::set_enabled(bool on) { rollback_on.store(on, std::memory_order_relaxed); }

bool Fp8StateRollback::needed() {
  const auto& a = fp8_autocast();
  return active_guards == 0 && a.enabled && a.recipe && a.recipe->kind == "delayed" && enabled();
}

Fp8StateRollback::Fp8StateRollback(const std::vector<std::shared_ptr<BasicOperation>>& ops) {
  if (!needed()) return;
  for (const auto& op : ops) {
    bool seen = false;  // an op that sits twice in a model is saved once
    for (const auto& s : saved_) seen = seen || s.op == op;
    if (seen || op->num_quantizers() == std::pair<int64_t, int64_t>{0, 0}) continue;
    const auto& state = op->fp8_state();
    saved_.push_back({op, state, state ? *state : Fp8OpState{}, op->fp8_recipe()});
    if (!state) continue;
    for (const auto* list : {&state->forward, &state->backward}) {
      for (const auto& d : *list) {
        tensors_.push_back(d.amax_history);
        tensors_.push_back(d.scale);
      }
    }
  }
  if (!tensors_.empty()) copy_values();
  active_ = true;  // last: a copy that raised leaves no active guard behind
  ++active_guards;
}

void Fp8StateRollback::copy_values() {
  const at::NoGradGuard no_grad;
  const c10::InferenceMode not_inference(false);
  bool one_device = true;
  std::vector<at::Tensor> flat;  // histories and scales are 1-D: no views to make
  flat.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    one_device = one_device && t.device() == tensors_[0].device();
    flat.push_back(t.dim() == 1 ? t : t.reshape({-1}));
  }
  if (one_device) {
    flat_ = at::cat(flat);  // one copy kernel: this runs on every call under delayed scaling
  } else {
    for (const auto& t : tensors_) clones_.push_back(t.clone());  // the rare path
  }
}

void Fp8StateRollback::commit() {
  if (!active_) return;
  active_ = false;
  --active_guards;
}

void Fp8StateRollback::restore() noexcept {
  try {
    const at::NoGradGuard no_grad;
    const c10::InferenceMode not_inference(false);
    for (const auto& s : saved_) {
      if (s.state) *s.state = s.handles;  // its own tensors back (a move or a resize replaces them)
      s.op->restore_fp8(s.state, s.recipe);
    }
    int64_t offset = 0;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto n = tensors_[i].numel();
      const auto& v = flat_.defined() ? flat_.narrow(0, offset, n) : clones_[i];
      tensors_[i].copy_(v.view(tensors_[i].sizes()));
      offset += n;
    }
  } catch (const std::exception& e) {
    TORCH_WARN("FP8 delayed scaling: could not put the state back after a failed call: ", e.what());
  }
}

Fp8StateRollback::~Fp8StateRollback() {
  if (!active_) return;
  --active_guards;
  restore();
}

}  // namespace fusible::ops

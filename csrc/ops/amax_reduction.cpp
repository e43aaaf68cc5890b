// The tracked states of each reduction group, their periods and their reduction.
#include "ops/amax_reduction.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/nan_to_num.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <cmath>
#include <iterator>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/fp8/fp8.h"
#include "ops/distributed.h"

namespace fusible::ops {
namespace {

constexpr const char* kOp = "fusible.autocast";

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One tracked state. Weak: a state the op replaced (or an op deleted) drops out by itself.
struct Entry {
  WeakTensor history, scale;
  // [3] on the state's device: the scratch state's amax and scale, then this rank's largest amax
  // since the last reduction.
  at::Tensor period;
  bool backward = false;
};

// A group's tracked states, in the order they were first tracked.
struct Registry {
  std::vector<Entry> entries;
  std::unordered_map<const c10::TensorImpl*, size_t> index;  // history -> its entry
};

std::mutex registry_mutex;  // a backward's casts may run on autograd's device threads

std::unordered_map<std::string, Registry>& registries() {
  static auto* r = new std::unordered_map<std::string, Registry>();  // never destroyed at exit
  return *r;
}

bool reduces(const Fp8Recipe& recipe) {
  return recipe.kind == "delayed" && recipe.amax_reduction_group.size > 1;
}

// A live entry, its tensors held for the reduction.
struct Live {
  at::Tensor history, scale, period;
  bool backward;
};

// The group's entries whose tensors live, of the recipe's history length; the dead ones dropped.
std::vector<Live> live_entries(const Fp8Recipe& recipe) {
  std::vector<Live> live;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registries().find(recipe.amax_reduction_group.name);
  if (it == registries().end()) return live;
  auto& reg = it->second;
  std::vector<Entry> kept;
  reg.index.clear();
  for (auto& e : reg.entries) {
    at::Tensor h(e.history.lock()), s(e.scale.lock());
    if (!h.defined() || !s.defined()) continue;
    // A state of another history length (another recipe's) waits for its own reductions.
    if (h.size(0) == recipe.amax_history_len) live.push_back({h, s, e.period, e.backward});
    reg.index[h.unsafeGetTensorImpl()] = kept.size();
    kept.push_back(std::move(e));
  }
  reg.entries = std::move(kept);
  return live;
}

// Every rank raises alike unless all track as many histories, of one length, each rank's on one
// device.
void check_ranks_agree(const Fp8Recipe& recipe, const std::vector<Live>& live) {
  bool mixed = false;
  for (const auto& e : live) mixed |= e.history.device() != live.front().history.device();
  const auto n = static_cast<float>(live.size());
  const auto len = static_cast<float>(recipe.amax_history_len);
  const auto flags = at::tensor(std::vector<float>{n, -n, len, -len, mixed ? 1.f : 0.f});
  const auto& group = recipe.amax_reduction_group;
  const auto agreed =
      wait(all_reduce_start(kOp, flags.to(recipe.amax_reduction_device), group, "max")).cpu();
  const float most = agreed[0].item<float>(), least = -agreed[1].item<float>();
  TORCH_CHECK(most == least, kOp, ": DelayedScaling's amax reduction over process group '",
              group.name, "': this rank has ", live.size(),
              " amax histories to reduce, the group's ranks between ", least, " and ", most,
              "; every rank must run the same FP8 ops (each op's first cast in the same order)");
  TORCH_CHECK(agreed[2].item<float>() == -agreed[3].item<float>(), kOp,
              ": DelayedScaling's amax reduction expects one amax_history_len on every rank of "
              "process group '",
              group.name, "'; this rank has ", recipe.amax_history_len);
  TORCH_CHECK(agreed[4].item<float>() == 0.f, kOp,
              ": DelayedScaling's amax reduction expects each rank's amax histories on one "
              "device; a rank has them on several");
}

// Each scale as a cast sets it from its (reduced) history, with its direction's format;
// unchanged where `rolled` is false (no rank saw a non-zero amax).
void rescale(const Fp8Recipe& recipe, const std::vector<Live>& live, const at::Tensor& rows,
             const at::Tensor& rolled) {
  const double factor = std::exp2(-recipe.margin);
  for (const bool backward : {false, true}) {
    std::vector<int64_t> picked;
    std::vector<at::Tensor> scales;
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].backward != backward) continue;
      picked.push_back(static_cast<int64_t>(i));
      scales.push_back(live[i].scale);
    }
    if (picked.empty()) continue;
    const auto at_rows = at::tensor(picked).to(rows.device());
    const auto h = rows.index_select(0, at_rows);
    const auto used = recipe.amax_compute_algo == "max" ? h.amax(1) : h.select(1, 0);
    const auto old = at::cat(scales);
    const double max =
        kernels::fp8_max(kOp, backward ? recipe.backward_format : recipe.forward_format);
    const auto scale = at::where(rolled.index_select(0, at_rows),
                                 kernels::reference::scale_for(used, max, factor, old), old);
    at::_foreach_copy_(scales, scale.split(1));
  }
}

}  // namespace

PeriodCast::PeriodCast(const Fp8Recipe& recipe, const std::vector<DelayedScaling>& states,
                       size_t index, bool backward) {
  if (!reduces(recipe)) return;
  TORCH_CHECK(index < states.size(), "FP8 delayed scaling: no state for tensor ", index);
  at::Tensor period;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& reg = registries()[recipe.amax_reduction_group.name];
    for (const auto& s : states) {  // an op's states, tracked at its first cast
      const auto* key = s.amax_history.unsafeGetTensorImpl();
      if (reg.index.count(key)) continue;
      reg.index[key] = reg.entries.size();
      reg.entries.push_back({WeakTensor(s.amax_history.getIntrusivePtr()),
                             WeakTensor(s.scale.getIntrusivePtr()),
                             at::zeros({3}, s.scale.options()), backward});
    }
    period = reg.entries[reg.index.at(states[index].amax_history.unsafeGetTensorImpl())].period;
  }
  // The cast rolls its amax into a one-entry history (a zero amax leaves the entry there, so a
  // reduction zeroes it) and casts with (then updates) a copy of the op's scale: copied again
  // first, as a checkpoint load writes the op's scale in place.
  scratch_.push_back({period.narrow(0, 0, 1), period.narrow(0, 1, 1)});
  scratch_.front().scale.copy_(states[index].scale);
  own_scale_ = states[index].scale;
  period_amax_ = period.narrow(0, 2, 1);
}

std::vector<at::Tensor> tracked_period_buffers(const Fp8Recipe& recipe,
                                               const std::vector<DelayedScaling>& states) {
  std::vector<at::Tensor> out;
  if (!reduces(recipe) || states.empty()) return out;
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto& reg = registries()[recipe.amax_reduction_group.name];
  for (const auto& s : states) {
    const auto it = reg.index.find(s.amax_history.unsafeGetTensorImpl());
    if (it != reg.index.end()) out.push_back(reg.entries[it->second].period);
  }
  return out;
}

size_t tracked_count(const Fp8Recipe& recipe) {
  if (!reduces(recipe)) return 0;
  std::lock_guard<std::mutex> lock(registry_mutex);
  return registries()[recipe.amax_reduction_group.name].entries.size();
}

void untrack_after(const Fp8Recipe& recipe, size_t count) {
  if (!reduces(recipe)) return;
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& reg = registries()[recipe.amax_reduction_group.name];
  if (reg.entries.size() <= count) return;
  reg.entries.erase(reg.entries.begin() + static_cast<std::ptrdiff_t>(count), reg.entries.end());
  for (auto it = reg.index.begin(); it != reg.index.end();) {
    it = it->second >= count ? reg.index.erase(it) : std::next(it);
  }
}

void PeriodCast::finish() const {
  if (scratch_.empty()) return;
  auto amax = period_amax_;  // the same tensor: maximum_out takes its output by reference
  at::maximum_out(amax, amax, scratch_.front().amax_history);
  // Whoever kept the cast's scale tensor (an FP8 weight casts its next write with it) reads the
  // period's.
  scratch_.front().scale.copy_(own_scale_);
}

void reduce_delayed_amaxes(const Fp8Recipe& recipe) {
  if (!reduces(recipe)) return;
  const auto live = live_entries(recipe);
  check_ranks_agree(recipe, live);
  if (live.empty()) return;
  const int64_t len = recipe.amax_history_len;
  std::vector<at::Tensor> histories, periods;
  for (const auto& e : live) {
    histories.push_back(e.history);
    periods.push_back(e.period);
  }
  const auto device = histories.front().device();
  const auto shared = at::stack(histories);  // [n, len]: every rank's alike after a reduction
  const auto period = at::stack(periods);    // [n, 3]
  // One roll of each history, reduced (max) in one collective. The older entries also align
  // ranks whose histories differed (each loaded its own checkpoint). A NaN entry (a loaded
  // history; the casts leave NaN elements out of their amax) counts as inf: a max over ranks then
  // agrees.
  const auto payload = at::cat({period.narrow(1, 2, 1), shared.narrow(1, 0, len - 1)}, 1)
                           .nan_to_num_(std::numeric_limits<float>::infinity());
  const auto reduced = wait(all_reduce_start(kOp, payload.to(recipe.amax_reduction_device),
                                             recipe.amax_reduction_group, "max"))
                           .to(device);
  // As te: a history rolls only for a non-zero amax (some rank cast non-zero values).
  const auto rolled = reduced.select(1, 0) != 0;
  const auto rows = at::where(rolled.unsqueeze(1), reduced.narrow(1, 0, len), shared);
  at::_foreach_copy_(histories, rows.unbind(0));
  rescale(recipe, live, rows, rolled);
  // A new period: its amaxes (the scratch history's and the period's) from 0, the scratch scales
  // the new scales.
  std::vector<at::Tensor> counters, scratch_scales, scales;
  for (size_t i = 0; i < live.size(); ++i) {
    counters.push_back(periods[i].narrow(0, 0, 1));
    counters.push_back(periods[i].narrow(0, 2, 1));
    scratch_scales.push_back(periods[i].narrow(0, 1, 1));
    scales.push_back(live[i].scale);
  }
  at::_foreach_zero_(counters);
  at::_foreach_copy_(scratch_scales, scales);
}

bool starts_amax_reduction(const Fp8Autocast& outer, const Fp8Autocast& inner) {
  const auto on = [](const Fp8Autocast& a) { return a.enabled && a.recipe && reduces(*a.recipe); };
  if (!on(inner)) return false;
  if (!on(outer)) return true;
  const auto& o = *outer.recipe;
  const auto& i = *inner.recipe;
  const bool same = o.forward_format == i.forward_format &&
                    o.backward_format == i.backward_format && o.margin == i.margin &&
                    o.amax_history_len == i.amax_history_len &&
                    o.amax_compute_algo == i.amax_compute_algo &&
                    o.amax_reduction_group.name == i.amax_reduction_group.name;
  TORCH_CHECK_NOT_IMPLEMENTED(
      same, kOp,
      ": a DelayedScaling autocast with an amax reduction inside another with a different recipe "
      "or group is not supported yet (the outer one's reductions would serve both)");
  return false;
}

}  // namespace fusible::ops

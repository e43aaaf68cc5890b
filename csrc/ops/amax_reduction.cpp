// The tracked histories of each reduction group, and their reduction.
#include "ops/amax_reduction.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <cmath>
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
  at::Tensor snapshot;  // the history as the last reduction left it (every rank's alike)
  int64_t casts = 0;    // this rank's casts since then
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
  at::Tensor history, scale, snapshot;
  int64_t casts;
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
    if (h.size(0) == recipe.amax_history_len)
      live.push_back({h, s, e.snapshot, e.casts, e.backward});
    reg.index[h.unsafeGetTensorImpl()] = kept.size();
    kept.push_back(std::move(e));
  }
  reg.entries = std::move(kept);
  return live;
}

// Every rank raises alike unless all track as many histories, each rank's on one device.
void check_ranks_agree(const Fp8Recipe& recipe, const std::vector<Live>& live) {
  bool mixed = false;
  for (const auto& e : live) mixed |= e.history.device() != live.front().history.device();
  const auto n = static_cast<float>(live.size());
  const auto flags = at::tensor(std::vector<float>{n, -n, mixed ? 1.f : 0.f});
  const auto& group = recipe.amax_reduction_group;
  const auto agreed =
      wait(all_reduce_start(kOp, flags.to(recipe.amax_reduction_device), group, "max")).cpu();
  const float most = agreed[0].item<float>(), least = -agreed[1].item<float>();
  TORCH_CHECK(most == least, kOp, ": DelayedScaling's amax reduction over process group '",
              group.name, "': this rank has ", live.size(),
              " amax histories to reduce, the group's ranks between ", least, " and ", most,
              "; every rank must run the same FP8 ops (each op's first cast in the same order)");
  TORCH_CHECK(agreed[2].item<float>() == 0.f, kOp,
              ": DelayedScaling's amax reduction expects each rank's amax histories on one "
              "device; a rank has them on several");
}

}  // namespace

std::optional<at::Tensor> track_delayed_cast(const Fp8Recipe& recipe,
                                             const std::vector<DelayedScaling>& states,
                                             size_t index, bool backward) {
  if (!reduces(recipe)) return std::nullopt;
  TORCH_CHECK(index < states.size(), "FP8 delayed scaling: no state for tensor ", index);
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& reg = registries()[recipe.amax_reduction_group.name];
    for (const auto& s : states) {  // new states: their histories before any cast
      const auto* key = s.amax_history.unsafeGetTensorImpl();
      if (reg.index.count(key)) continue;
      reg.index[key] = reg.entries.size();
      reg.entries.push_back({WeakTensor(s.amax_history.getIntrusivePtr()),
                             WeakTensor(s.scale.getIntrusivePtr()), s.amax_history.clone(), 0,
                             backward});
    }
    reg.entries[reg.index.at(states[index].amax_history.unsafeGetTensorImpl())].casts += 1;
  }
  return states[index].scale.clone();
}

void reduce_delayed_amaxes(const Fp8Recipe& recipe) {
  if (!reduces(recipe)) return;
  const auto live = live_entries(recipe);
  check_ranks_agree(recipe, live);
  if (live.empty()) return;
  const int64_t n = static_cast<int64_t>(live.size()), len = recipe.amax_history_len;
  std::vector<at::Tensor> histories, scales, snapshots;
  std::vector<float> casts;
  for (const auto& e : live) {
    histories.push_back(e.history);
    scales.push_back(e.scale);
    snapshots.push_back(e.snapshot);
    casts.push_back(static_cast<float>(e.casts));
  }
  const auto device = histories.front().device();
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto local = at::stack(histories), before = at::stack(snapshots);
  const auto counts = at::tensor(casts).to(device);
  // The period's amax on this rank: the max of the entries its casts put at the front (0 if none).
  const auto mine = at::arange(len, opts).unsqueeze(0) < counts.unsqueeze(1);
  const auto newest = local.masked_fill(mine.logical_not(), 0.f).amax(1, /*keepdim=*/true);
  // One roll of the shared history, and the casts: all reduced (max) in one collective.
  const auto payload = at::cat({newest, before.narrow(1, 0, len - 1), counts.unsqueeze(1)}, 1);
  const auto reduced = wait(all_reduce_start(kOp, payload.to(recipe.amax_reduction_device),
                                             recipe.amax_reduction_group, "max"))
                           .to(device);
  const auto cast_somewhere = reduced.select(1, len) > 0;
  const auto rows = at::where(cast_somewhere.unsqueeze(1), reduced.narrow(1, 0, len), before);
  const auto row_list = rows.unbind(0);
  at::_foreach_copy_(histories, row_list);
  at::_foreach_copy_(snapshots, row_list);
  // Each scale as a cast sets it from its history, with its direction's format; unchanged where
  // no rank cast the tensor.
  const double factor = std::exp2(-recipe.margin);
  for (const bool backward : {false, true}) {
    std::vector<int64_t> picked;
    for (int64_t i = 0; i < n; ++i) {
      if (live[static_cast<size_t>(i)].backward == backward) picked.push_back(i);
    }
    if (picked.empty()) continue;
    const auto at_rows = at::tensor(picked).to(device);
    const auto h = rows.index_select(0, at_rows);
    const auto used = recipe.amax_compute_algo == "max" ? h.amax(1) : h.select(1, 0);
    std::vector<at::Tensor> ss;
    for (auto i : picked) ss.push_back(scales[static_cast<size_t>(i)]);
    const auto old = at::cat(ss);
    const double max =
        kernels::fp8_max(kOp, backward ? recipe.backward_format : recipe.forward_format);
    const auto scale = at::where(cast_somewhere.index_select(0, at_rows),
                                 kernels::reference::scale_for(used, max, factor, old), old);
    at::_foreach_copy_(ss, scale.split(1));
  }
  std::lock_guard<std::mutex> lock(registry_mutex);  // a new period starts
  auto& reg = registries()[recipe.amax_reduction_group.name];
  for (const auto& h : histories) {
    auto it = reg.index.find(h.unsafeGetTensorImpl());
    if (it != reg.index.end()) reg.entries[it->second].casts = 0;
  }
}

}  // namespace fusible::ops

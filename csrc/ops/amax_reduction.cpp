// The amax histories tracked per reduction group, and their reduction.
#include "ops/amax_reduction.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels/fp8/fp8.h"
#include "ops/distributed.h"

namespace fusible::ops {
namespace {

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// One tracked state. Weak: a state the op replaced (or an op deleted) drops out by itself.
struct Entry {
  const c10::TensorImpl* key;  // the history's, while `history` keeps the object
  WeakTensor history, scale;
  bool backward;
};

// A group's tracked states, in the order of their first cast.
struct Registry {
  std::vector<Entry> entries;
  std::unordered_set<const c10::TensorImpl*> known;
  std::optional<c10::Device> device;
};

std::mutex mutex;  // casts of a backward may run on autograd's device threads

std::unordered_map<std::string, Registry>& registries() {
  static auto* r = new std::unordered_map<std::string, Registry>();  // never destroyed at exit
  return *r;
}

bool reduces(const Fp8Recipe& recipe) {
  return recipe.kind == "delayed" && recipe.amax_reduction_group.size > 1;
}

at::Tensor locked(const WeakTensor& w) { return at::Tensor(w.lock()); }

}  // namespace

void track_delayed_amax(const Fp8Recipe& recipe, const DelayedScaling& s, bool backward) {
  if (!reduces(recipe)) return;
  std::lock_guard<std::mutex> lock(mutex);
  auto& reg = registries()[recipe.amax_reduction_group.name];
  const auto* key = s.amax_history.unsafeGetTensorImpl();
  if (!reg.known.insert(key).second) return;
  reg.entries.push_back({key, WeakTensor(s.amax_history.getIntrusivePtr()),
                         WeakTensor(s.scale.getIntrusivePtr()), backward});
  if (!reg.device) reg.device = s.amax_history.device();
}

void reduce_delayed_amaxes(const Fp8Recipe& recipe) {
  if (!reduces(recipe)) return;
  constexpr const char* op = "fusible.autocast";
  const auto& group = recipe.amax_reduction_group;
  std::vector<at::Tensor> histories, scales;
  std::vector<bool> backward;
  c10::Device device = c10::kCPU;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = registries().find(group.name);
    if (it == registries().end() || !it->second.device) return;  // no cast tracked yet
    auto& reg = it->second;
    device = *reg.device;
    std::vector<Entry> live;
    for (auto& e : reg.entries) {
      auto h = locked(e.history), s = locked(e.scale);
      if (!h.defined() || !s.defined()) {
        reg.known.erase(e.key);
        continue;
      }
      if (h.size(0) == recipe.amax_history_len) {  // a state of another recipe waits for its own
        TORCH_CHECK(h.device() == device, op,
                    ": DelayedScaling's amax reduction expects every amax history on ", device,
                    ", got one on ", h.device());
        histories.push_back(h);
        scales.push_back(s);
        backward.push_back(e.backward);
      }
      live.push_back(std::move(e));
    }
    reg.entries = std::move(live);
  }
  // Ranks that tracked different states would pair unrelated histories (or hang on sizes that
  // differ): one small collective checks first, and every rank raises alike.
  const auto n = static_cast<float>(histories.size());
  const auto counts = at::tensor(std::vector<float>{n, -n}).to(device);
  const auto agreed = wait(all_reduce_start(op, counts, group, "max")).cpu();
  const float most = agreed[0].item<float>(), least = -agreed[1].item<float>();
  TORCH_CHECK(most == least, op, ": DelayedScaling's amax reduction over process group '",
              group.name, "': this rank has ", histories.size(),
              " amax histories to reduce, the group's ranks between ", least, " and ", most,
              "; every rank must run the same FP8 casts (each tensor's first cast in the same "
              "order)");
  if (histories.empty()) return;
  const auto reduced = wait(all_reduce_start(op, at::stack(histories), group, "max"));
  const auto rows = reduced.unbind(0);
  at::_foreach_copy_(histories, rows);
  // Each scale as the cast's update sets it, with its direction's format.
  const double factor = std::exp2(-recipe.margin);
  for (const bool dir : {false, true}) {
    std::vector<at::Tensor> hs, ss;
    for (size_t i = 0; i < histories.size(); ++i) {
      if (backward[i] != dir) continue;
      hs.push_back(rows[static_cast<int64_t>(i)]);
      ss.push_back(scales[i]);
    }
    if (hs.empty()) continue;
    const auto h = at::stack(hs);
    const auto used = recipe.amax_compute_algo == "max" ? h.amax(1) : h.select(1, 0);
    const double max = kernels::fp8_max(op, dir ? recipe.backward_format : recipe.forward_format);
    const auto scale = kernels::reference::scale_for(used, max, factor, at::cat(ss));
    at::_foreach_copy_(ss, scale.split(1));
  }
}

}  // namespace fusible::ops

// FusionRegistry.
#include "ops/fusion_registry.h"

#include <algorithm>

#include "ops/fused/builtin_fusions.h"

namespace fusible::ops {

FusionRegistry& FusionRegistry::instance() {
  // Never destroyed: fusers may still plan while the process exits.
  static FusionRegistry* registry = [] {
    auto* r = new FusionRegistry;
    register_builtin_fusions(*r);
    return r;
  }();
  return *registry;
}

int64_t FusionRegistry::add(std::string name, FusionPass pass, FusionFunction fn, bool prepend) {
  const std::lock_guard lock(mutex_);
  const int64_t id = next_id_++;
  FusionEntry entry{id, std::move(name), pass, std::move(fn)};
  if (prepend) {
    entries_.insert(entries_.begin(), std::move(entry));
  } else {
    entries_.push_back(std::move(entry));
  }
  ++version_;
  return id;
}

bool FusionRegistry::remove(int64_t id) {
  FusionEntry removed;  // destroyed after the lock: a Python function's release takes the GIL
  const std::lock_guard lock(mutex_);
  const auto it = std::find_if(entries_.begin(), entries_.end(),
                               [id](const FusionEntry& e) { return e.id == id; });
  if (it == entries_.end()) return false;
  removed = std::move(*it);
  entries_.erase(it);
  ++version_;
  return true;
}

std::vector<FusionEntry> FusionRegistry::entries(FusionPass pass) const {
  const std::lock_guard lock(mutex_);
  std::vector<FusionEntry> out;
  for (const auto& e : entries_) {
    if (e.pass == pass) out.push_back(e);
  }
  return out;
}

std::vector<FusionEntry> FusionRegistry::snapshot() const {
  const std::lock_guard lock(mutex_);
  return entries_;
}

void FusionRegistry::restore(std::vector<FusionEntry> snapshot) {
  const std::lock_guard lock(mutex_);
  std::swap(entries_, snapshot);  // the old entries go with `snapshot`, after the lock
  ++version_;
}

int64_t FusionRegistry::version() const {
  const std::lock_guard lock(mutex_);
  return version_;
}

}  // namespace fusible::ops

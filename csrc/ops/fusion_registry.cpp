// FusionRegistry.
#include "ops/fusion_registry.h"

#include <algorithm>

#include "ops/fused/builtin_fusions.h"

namespace fusible::ops {

FusionRegistry& FusionRegistry::instance() {
  static FusionRegistry registry = [] {
    FusionRegistry r;
    register_builtin_fusions(r);
    return r;
  }();
  return registry;
}

int64_t FusionRegistry::add(std::string name, FusionPass pass, FusionFunction fn, bool prepend) {
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
  const auto it = std::find_if(entries_.begin(), entries_.end(),
                               [id](const FusionEntry& e) { return e.id == id; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  ++version_;
  return true;
}

std::vector<FusionEntry> FusionRegistry::entries(FusionPass pass) const {
  std::vector<FusionEntry> out;
  for (const auto& e : entries_) {
    if (e.pass == pass) out.push_back(e);
  }
  return out;
}

void FusionRegistry::restore(std::vector<FusionEntry> snapshot) {
  entries_ = std::move(snapshot);
  ++version_;
}

}  // namespace fusible::ops

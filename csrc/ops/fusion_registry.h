// The ordered registry of fusion functions: each maps an op list to an op list and is read when a
// fuser builds a plan. Joint (forward-and-backward) functions run first, then forward-only ones on
// the forward plan and backward-only ones on the backward plan.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/fusible_operation.h"

namespace fusible::ops {

using OpList = std::vector<std::shared_ptr<FusibleOperation>>;

/// What a fusion function may look at besides the ops.
struct FusionContext {
  /// The FP8 autocast recipe's kind ("current", "delayed", "block"), empty when FP8 is off.
  std::string recipe;
  /// First basic op whose backward runs (ops before it need no backward fusion).
  int64_t first_backward = 0;
  /// The call's parameter dtypes, per basic op (fusion preconditions may compare them: a plan is
  /// cached per dtype signature).
  std::unordered_map<const BasicOperation*, std::vector<at::ScalarType>> param_dtypes;
  /// Each basic op's index in the fuser, its first for an op at several positions (backward
  /// fusions compare it with first_backward).
  std::unordered_map<const BasicOperation*, int64_t> basic_index;

  /// Whether `op`'s backward runs in the call being planned.
  bool runs_backward(const BasicOperation& op) const {
    const auto it = basic_index.find(&op);
    return it != basic_index.end() && it->second >= first_backward;
  }

  /// Dtype of parameter i of `op` in the call being planned.
  at::ScalarType param_dtype(const BasicOperation& op, size_t i) const {
    const auto it = param_dtypes.find(&op);
    TORCH_CHECK(it != param_dtypes.end() && i < it->second.size(), op.type_name(),
                ": no parameter ", i, " in the call being planned");
    return it->second[i];
  }
};

using FusionFunction = std::function<OpList(OpList, const FusionContext&)>;

enum class FusionPass { kForwardBackward, kForward, kBackward };

struct FusionEntry {
  int64_t id;
  std::string name;
  FusionPass pass;
  FusionFunction fn;
};

/// Process-wide, ordered. Thread-safe: fusers read it without the GIL while Python code may
/// register or remove fusions.
class FusionRegistry {
 public:
  static FusionRegistry& instance();

  /// Appends (or prepends) a fusion; returns its id for remove().
  int64_t add(std::string name, FusionPass pass, FusionFunction fn, bool prepend = false);
  /// Removes by id; returns whether it was there.
  bool remove(int64_t id);
  /// The entries of one pass, in order.
  std::vector<FusionEntry> entries(FusionPass pass) const;
  /// Every entry, for snapshot/restore in tests.
  std::vector<FusionEntry> snapshot() const;
  void restore(std::vector<FusionEntry> snapshot);
  /// Changes whenever the registry changes, so fusers know to re-plan.
  int64_t version() const;

 private:
  FusionRegistry() = default;

  mutable std::mutex mutex_;  // guards everything below
  std::vector<FusionEntry> entries_;
  int64_t next_id_ = 1;
  int64_t version_ = 0;
};

}  // namespace fusible::ops

// Puts the ops' delayed-scaling state back when a call raises part way.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "ops/quantization.h"

namespace fusible::ops {

class BasicOperation;

/// Under a DelayedScaling autocast each FP8 cast rolls its op's amax history and sets the next
/// scale as the forward runs, so a call that raises after some casts (a wrong extra input in the
/// last op, say) would keep their updates: the module would not be left as it was. Made before a
/// call, this guard snapshots the ops' states (one copy kernel for all of them) and, destroyed
/// without commit(), puts them back: the same state objects and tensors, with their values.
/// Nothing happens without a delayed-scaling autocast; a guard made inside another (a Sequential's
/// fusers) leaves the work to the outermost.
class Fp8StateRollback {
 public:
  explicit Fp8StateRollback(const std::vector<std::shared_ptr<BasicOperation>>& ops);
  ~Fp8StateRollback();
  Fp8StateRollback(const Fp8StateRollback&) = delete;
  Fp8StateRollback& operator=(const Fp8StateRollback&) = delete;

  /// Whether a guard made now would act (callers skip gathering their ops otherwise).
  static bool needed();

  /// On by default; off only for benchmarks that measure what the snapshot costs. Process-wide.
  static bool enabled();
  static void set_enabled(bool on);

  /// The call succeeded: keep the states as they are now.
  void commit();

 private:
  struct Saved {
    std::shared_ptr<BasicOperation> op;
    std::shared_ptr<Fp8OpState> state;  // the op's state object (null: it had none)
    Fp8OpState handles;                 // its tensors and formats as they were
    std::shared_ptr<const Fp8Recipe> recipe;
  };
  void copy_values();
  void restore() noexcept;

  bool active_ = false;
  std::vector<Saved> saved_;
  std::vector<at::Tensor> tensors_;  // every saved history and scale, in order
  at::Tensor flat_;                  // their values, in one tensor where all share a device
  std::vector<at::Tensor> clones_;   // else one clone each
};

}  // namespace fusible::ops

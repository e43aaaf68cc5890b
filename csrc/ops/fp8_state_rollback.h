// Puts the ops' delayed-scaling state back when a call raises part way.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "ops/quantization.h"

namespace fusible::ops {

class BasicOperation;

/// Under a DelayedScaling autocast each FP8 cast rolls its op's amax history and sets the next
/// scale as the forward runs (under an amax reduction, its period's amax), so a call that raises
/// after some casts (a wrong extra input in the last op, say) would keep their updates: the module
/// would not be left as it was. Made before a call, this guard snapshots its ops' states (one
/// at::cat of all their tensors) and, destroyed without commit(), puts them back: the same state
/// objects and tensors, with their values, and each op's recipe. Nothing happens without a
/// delayed-scaling autocast. Guards nest (a Sequential, its fusers, a plain step calling another
/// model): an inner one saves only the ops no outer one holds, and its commit hands them to the
/// one around it, so an outer call that fails later puts them back too.
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

  /// The call succeeded: keep the states as they are now (an outer guard still holds them).
  void commit();

 private:
  struct Saved {
    std::shared_ptr<BasicOperation> op;
    std::shared_ptr<Fp8OpState> state;  // the op's state object (null: it had none)
    Fp8OpState handles;                 // its tensors and formats as they were
    std::shared_ptr<const Fp8Recipe> recipe;
  };
  struct Snapshot {
    std::vector<Saved> saved;
    std::vector<at::Tensor> tensors;  // every saved history, scale and period buffer, in order
    at::Tensor flat;                  // their values, in one tensor where all share a device
    std::vector<at::Tensor> clones;   // else one clone each
    void copy_values();
    void restore() const;
  };
  void release();  // off the thread's stack; the ops no longer held unless handed on

  bool active_ = false;
  std::vector<Snapshot> snapshots_;  // this guard's own, then those inner guards handed over
};

}  // namespace fusible::ops

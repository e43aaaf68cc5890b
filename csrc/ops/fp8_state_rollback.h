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
/// objects and tensors, with their values, each op's recipe, and the amax reduction's tracking as
/// it was. Nothing happens without a delayed-scaling autocast. Guards nest (a plain step calling
/// another model, a Python op inside a fuser): each saves its own ops, and its commit hands its
/// snapshots to the guard around it, so an outer call that fails later puts those ops back too
/// (its own snapshot, the earliest, last). A failure an inner guard put back and user code caught
/// stays put back. Not safe for one model used by several threads at once: a failing call puts
/// back the state as its thread saw it.
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
    std::shared_ptr<const Fp8Recipe> recipe;  // the autocast's: its amax reduction's tracking
    size_t tracked = 0;                       // how many states that reduction tracked
    std::vector<Saved> saved;
    std::vector<at::Tensor> tensors;  // every saved history, scale and period buffer, in order
    at::Tensor flat;                  // their values, in one tensor where all share a device
    std::vector<at::Tensor> clones;   // else one clone each
    void copy_values();
    void restore() const;
  };

  bool active_ = false;
  std::vector<Snapshot> snapshots_;  // this guard's own, then those inner guards handed over
};

}  // namespace fusible::ops

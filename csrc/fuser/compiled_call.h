// torch.compile's view of a Sequential: fusible::sequential_call runs a whole call as one op whose
// inputs are all its tensors (parameters included), and fusible::sequential_call_backward is its
// backward, by recomputation. A compiled graph names its Sequential by an integer handle; a
// resolver (set by the Python bindings) maps a handle to the Sequential's engine.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "fuser/sequential.h"

namespace fusible::fuser {

/// handle -> the engine to run (throws when the handle names nothing runnable).
using SequentialResolver = std::function<std::shared_ptr<Sequential>(int64_t handle)>;

/// Sets the resolver, asked for a handle not seen yet or whose engine was rebuilt since (the
/// answer is kept, weakly, until then).
void set_sequential_resolver(SequentialResolver resolver);

/// The number of tensors the Sequential's ops cast in a forward under DelayedScaling: the length
/// of sequential_call's last output under that recipe (its fake kernel needs it).
int64_t delayed_scale_count(Sequential& seq);

/// Drops what is kept for handle: its Sequential changed (or a new one took the handle).
void forget_sequential(int64_t handle);

}  // namespace fusible::fuser

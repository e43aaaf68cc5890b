// The built-in fusions, registered in one deliberate order (te.ops' ops/fused/__init__.py order,
// with ours placed where they must run).
#pragma once

#include "ops/fusion_registry.h"

namespace fusible::ops {

/// Adds every built-in fusion to `registry`, in order. Called once, when the registry is made.
void register_builtin_fusions(FusionRegistry& registry);

}  // namespace fusible::ops

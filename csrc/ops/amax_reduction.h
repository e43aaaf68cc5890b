// DelayedScaling across ranks (te's reduce_amax): each cast records its amax in its own history at
// once (as on one process); the histories a group's casts recorded are then reduced (elementwise
// MAX over the ranks) in one collective, and each scale recomputed from its reduced history, at
// points every rank reaches together: fusible.autocast's entry and exit. Every rank then casts with
// the same scales, those of the whole tensor (a tensor-parallel shard's scale is the full
// weight's).
#pragma once

#include "ops/quantization.h"

namespace fusible::ops {

/// Notes that a cast under `recipe` recorded into state `s` (a forward tensor's unless
/// `backward`): reduce_delayed_amaxes reduces its history from now on. A no-op unless the recipe
/// has an amax reduction group of more than one rank.
void track_delayed_amax(const Fp8Recipe& recipe, const DelayedScaling& s, bool backward);

/// The collective: reduces every history tracked for recipe.amax_reduction_group whose tensors are
/// alive and whose length is the recipe's (in the order of their first cast, which every rank must
/// share), and sets each scale from its reduced history as a cast would. Raises on every rank,
/// instead of hanging, where the ranks track different numbers of histories. A no-op without a
/// group of more than one rank.
void reduce_delayed_amaxes(const Fp8Recipe& recipe);

}  // namespace fusible::ops

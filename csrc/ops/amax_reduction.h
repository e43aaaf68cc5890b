// DelayedScaling across ranks (te's reduce_amax). Between two reductions ("a period") every cast
// of a tracked tensor uses the scale of the last reduction, and its amax is recorded locally. A
// reduction (one collective, at the outermost fusible.autocast's entry and exit) then gives each
// tracked history, on every rank, one new entry: the max over the ranks of the period's amaxes (0
// from a rank that did not cast the tensor); a tensor that no rank cast keeps its history. Each
// scale follows from its history as a cast would set it. So every rank casts with the same scales,
// those of the whole tensor: a tensor-parallel shard's scale is the full weight's.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "ops/quantization.h"

namespace fusible::ops {

/// Before a delayed cast of `states[index]` (one of an op's forward tensors unless `backward`)
/// under `recipe`: tracks all of `states` for the reduction (as te registers all of a module's
/// quantizers: a GroupedLinear's expert without rows on one rank still pairs with the others) and
/// counts the cast. Returns the scale to put back after the cast (the period's), or nullopt
/// without an amax reduction group of more than one rank.
std::optional<at::Tensor> track_delayed_cast(const Fp8Recipe& recipe,
                                             const std::vector<DelayedScaling>& states,
                                             size_t index, bool backward);

/// The reduction over recipe.amax_reduction_group: a collective every rank of the group calls at
/// the same point. First a small collective checks that the ranks track as many histories (on one
/// device each), and every rank raises alike where they do not, instead of pairing unrelated
/// histories or hanging. A no-op without a group of more than one rank.
void reduce_delayed_amaxes(const Fp8Recipe& recipe);

}  // namespace fusible::ops

// DelayedScaling across ranks (te's reduce_amax). Between two reductions ("a period") every cast
// of a tracked tensor uses the scale of the last reduction and leaves the tensor's history alone:
// each rank keeps the largest amax its casts saw on the device (so a captured CUDA graph's
// replays count too). A reduction (at the outermost fusible.autocast's entry and exit) then gives
// each tracked history, on every rank, one new entry: the max over the ranks of the period's
// amaxes (0 from a rank that did not cast the tensor); as in te, a history whose new amax is 0
// (no rank cast non-zero values) keeps its entries and its scale. Each scale follows from its
// history as a cast would set it. So every rank
// casts with the same scales, those of the whole tensor: a tensor-parallel shard's scale is the
// full weight's.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "ops/quantization.h"

namespace fusible::ops {

/// One delayed cast of `states[index]` (an op's forward tensors unless `backward`) under `recipe`.
/// With an amax reduction group of more than one rank it tracks all of `states` (as te registers
/// all of a module's quantizers: a GroupedLinear's expert without rows on one rank still pairs
/// with the others) and the cast goes to a scratch state holding the period's scale; else the
/// cast uses the op's own state.
class PeriodCast {
 public:
  PeriodCast(const Fp8Recipe& recipe, const std::vector<DelayedScaling>& states, size_t index,
             bool backward);
  /// The states and index the cast uses.
  const std::vector<DelayedScaling>& states(const std::vector<DelayedScaling>& own) const {
    return scratch_.empty() ? own : scratch_;
  }
  size_t index(size_t own) const { return scratch_.empty() ? own : 0; }
  /// After the cast: its amax joins the period's.
  void finish() const;

 private:
  std::vector<DelayedScaling> scratch_;  // one state: views into the tracked entry's buffer
  at::Tensor own_scale_, period_amax_;
};

/// For Fp8StateRollback: the period buffers of those of `states` tracked under recipe's reduction
/// group (what their casts change instead of the states), how many states the group tracks, and
/// dropping those tracked after the first `count` (a failed call's first casts tracked them, its
/// amaxes in their periods). None / 0 / a no-op without a reduction.
std::vector<at::Tensor> tracked_period_buffers(const Fp8Recipe& recipe,
                                               const std::vector<DelayedScaling>& states);
size_t tracked_count(const Fp8Recipe& recipe);
void untrack_after(const Fp8Recipe& recipe, size_t count);

/// The reduction over recipe.amax_reduction_group: a collective every rank of the group calls at
/// the same point. First a small collective checks that the ranks track as many histories, of the
/// recipe's length and on one device each, and every rank raises alike where they do not, instead
/// of pairing unrelated histories or hanging. A no-op without a group of more than one rank.
void reduce_delayed_amaxes(const Fp8Recipe& recipe);

/// Whether the autocast `inner`, entered inside `outer`, is the one that reduces (the outermost
/// whose recipe reduces amaxes, as te's). Raises NotImplementedError where both reduce with
/// different recipes or groups: one set of reductions cannot serve both.
bool starts_amax_reduction(const Fp8Autocast& outer, const Fp8Autocast& inner);

}  // namespace fusible::ops

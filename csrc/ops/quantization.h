// FP8 autocast: the recipe in effect on this thread, and what an op fixes from it at its forward
// for its backward. The casts are fusible::fp8_quantize_dequantize: the values an FP8 GEMM computes
// with, so every fusion that goes through BasicLinear's forward and backward stays valid under FP8.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/distributed.h"

namespace fusible::ops {

/// A recipe as the ops need it. kind: "current" (Float8CurrentScaling), "delayed" (DelayedScaling)
/// or "block" (Float8BlockScaling); formats "e4m3" / "e5m2" per direction (HYBRID: e4m3 forward,
/// e5m2 backward).
struct Fp8Recipe {
  std::string kind = "current";
  std::string forward_format = "e4m3";
  std::string backward_format = "e5m2";
  double margin = 0.0;
  // DelayedScaling only: the history length and "max" or "most_recent".
  int64_t amax_history_len = 1024;
  std::string amax_compute_algo = "max";
  // Float8BlockScaling only: 1 (1x128 blocks) or 2 (128x128) for inputs, weights and gradients;
  // scales are powers of two.
  int64_t x_block_dim = 1, w_block_dim = 2, grad_block_dim = 1;
  // A linear over fewer rows (tokens) than this runs without FP8, its GEMMs in the compute dtype
  // (the recipe's fp8_min_tokens, an opt-in for shapes too small to pay for the casts); 0: never.
  int64_t min_tokens = 0;
  // DelayedScaling with te's reduce_amax on a distributed run: the process group whose ranks share
  // each tensor's amax history (ops/amax_reduction.h); size 1 (the default): none. The reduction's
  // collectives run on amax_reduction_device (a CUDA device for NCCL, the CPU for gloo).
  ProcessGroupSpec amax_reduction_group;
  c10::Device amax_reduction_device = c10::kCPU;
};

/// One tensor's delayed-scaling state (fp32, on the tensor's device): its amax history, newest
/// first, and the scale its next cast uses (computed from the history after each cast).
struct DelayedScaling {
  at::Tensor amax_history;  // [amax_history_len]
  at::Tensor scale;         // [1]
};

/// An op's delayed-scaling states (te.ops' quantizers): one per tensor the op casts, per
/// direction. Made at the op's first forward under a DelayedScaling autocast; kept on the op
/// (its checkpoint's _extra_state), moved with the op's device, its histories cut or padded
/// when the history length changes (scales kept, te.ops' rule).
struct Fp8OpState {
  std::vector<DelayedScaling> forward, backward;
  /// The FP8 formats ("e4m3" / "e5m2") the scales were computed for ("": unknown, as in an older
  /// checkpoint): a recipe of another format rescales them first (current_fp8_cast).
  std::string forward_format, backward_format;
};

/// The FP8 autocast of this thread: off, or on with a recipe.
struct Fp8Autocast {
  bool enabled = false;
  std::shared_ptr<const Fp8Recipe> recipe;
};

/// This thread's FP8 autocast.
const Fp8Autocast& fp8_autocast();

/// Sets this thread's FP8 autocast for its lifetime (C++'s `fusible.autocast`). An enabled one
/// needs a recipe of a kind that is supported (ValueError otherwise). The outermost
/// enabled guard whose recipe reduces amaxes across ranks runs reduce_delayed_amaxes
/// (ops/amax_reduction.h), a collective, when constructed and when destroyed (except during an
/// exception; a failure there is a warning); `reduce_amaxes` false: never (an internal scope).
class Fp8AutocastGuard {
 public:
  Fp8AutocastGuard(bool enabled, std::shared_ptr<const Fp8Recipe> recipe,
                   bool reduce_amaxes = true);
  ~Fp8AutocastGuard();
  Fp8AutocastGuard(const Fp8AutocastGuard&) = delete;
  Fp8AutocastGuard& operator=(const Fp8AutocastGuard&) = delete;

 private:
  bool reduces_;  // first: decided (and checked) before the autocast changes
  Fp8Autocast saved_;
  int exceptions_;  // std::uncaught_exceptions() at construction
};

/// Replaces this thread's FP8 autocast, returning the previous one (for bindings whose scopes
/// are not C++ scopes). Checks as the guard does.
Fp8Autocast exchange_fp8_autocast(Fp8Autocast autocast);

/// Whether FP8 current scaling's casts take the amax the kernel producing their tensor computed
/// (OperationContext's amax handoff; on by default). Either way the casts write the same bytes:
/// the switch is there for tests and benchmarks that compare the two. Process-wide.
bool fp8_amax_handoff();
void set_fp8_amax_handoff(bool on);

/// A recipe as one string, and back: a compiled graph's call carries the recipe of its forward
/// this way to its backward, which runs outside the autocast. "" is no recipe (FP8 off).
std::string recipe_key(const Fp8Recipe* recipe);
std::shared_ptr<const Fp8Recipe> recipe_from_key(const std::string& key);

/// One op's delayed-scaling state and its (forward, backward) quantizer counts.
struct OpFp8State {
  std::shared_ptr<Fp8OpState> state;
  std::pair<int64_t, int64_t> counts;
};

/// Under DelayedScaling: the scales the next forward of these ops casts with, one per forward
/// quantizer in op order, fp32 on `device` (1 where the forward makes a fresh state).
at::Tensor delayed_forward_scales(const std::vector<OpFp8State>& ops, c10::Device device);

/// While alive, this thread replays a forward under DelayedScaling: a cast of one of these ops'
/// forward tensors uses the scale delayed_forward_scales recorded and leaves the history alone;
/// their backward tensors cast (and record) as usual. A compiled call's backward recomputes its
/// forward so, and computes what the eager backward would.
class Fp8ReplayGuard {
 public:
  Fp8ReplayGuard(const std::vector<OpFp8State>& ops, const at::Tensor& scales);
  /// Replays each state (key) with the given replay state (its forward casts start from it).
  explicit Fp8ReplayGuard(
      std::vector<std::pair<const Fp8OpState*, std::shared_ptr<Fp8OpState>>> replay);
  ~Fp8ReplayGuard();
  Fp8ReplayGuard(const Fp8ReplayGuard&) = delete;
  Fp8ReplayGuard& operator=(const Fp8ReplayGuard&) = delete;

 private:
  std::vector<std::pair<const Fp8OpState*, std::shared_ptr<Fp8OpState>>> replay_, saved_;
};

/// The delayed-scaling states an activation checkpoint's forward cast with, each with copies of
/// its forward histories and scales as they were before its first cast there (fusible.checkpoint):
/// its recompute replays them (Fp8ReplayGuard), casting as the forward did, casts after the first
/// included, and leaving the real histories alone.
struct Fp8Record {
  std::vector<OpFp8State> ops;
  std::vector<std::vector<DelayedScaling>> forward;  // per op: the copies
  /// The Fp8ReplayGuard of the recorded casts (fresh copies: a recompute may run more than once).
  std::unique_ptr<Fp8ReplayGuard> replay() const;
};

/// While alive, this thread's delayed-scaling forward casts are recorded into `record` and into
/// every record whose guard is alive around it (nested checkpoints: each recompute replays its
/// own).
class Fp8RecordGuard {
 public:
  explicit Fp8RecordGuard(std::shared_ptr<Fp8Record> record);
  ~Fp8RecordGuard();
  Fp8RecordGuard(const Fp8RecordGuard&) = delete;
  Fp8RecordGuard& operator=(const Fp8RecordGuard&) = delete;
};

/// One tensor as a linear's GEMMs take it (ops/linear_gemms.h).
/// - High precision (no FP8, or FP8 emulated by a cast and back): `rowwise` is the tensor the
///   forward and dgrad GEMMs read, `columnwise` the one the wgrad GEMM reads (the same tensor but
///   under block scaling, which casts it along the other dim).
/// - FP8 data: `rowwise` [..., K] and its transpose `columnwise` [K, M] (Hopper's FP8 GEMM reads
///   both operands with K contiguous) with their fp32 scale_inv: per-tensor ([1], the same for
///   both; block 0), or under block scaling each its own block scales (block 1: 1x128 blocks,
///   2: 128x128; kernels/fp8/fp8_block.h).
/// Either may be undefined where no GEMM reads it. `dtype`: the compute dtype, the GEMMs' output.
struct GemmOperand {
  at::Tensor rowwise, columnwise, scale_inv, columnwise_scale_inv;
  at::ScalarType dtype = at::kFloat;
  int64_t block = 0;
  bool fp8() const { return scale_inv.defined() || columnwise_scale_inv.defined(); }
};

/// What one op's forward quantized with, kept for its backward (which may run on another thread,
/// outside the autocast): off, or the recipe.
struct Fp8Cast {
  std::shared_ptr<const Fp8Recipe> recipe;
  std::shared_ptr<Fp8OpState> state;  // DelayedScaling's; null for current scaling
  /// Whether the GEMMs run on FP8 data (set by the op's forward where fp8_gemms_fit): else a
  /// recipe is emulated by casts to FP8 and back and GEMMs in the compute dtype.
  bool gemm_fp8 = false;
  /// With gemm_fp8: 1 / scale of each FP8 tensor the op saved, by saved slot (the saved tensors
  /// keep BasicLinear's (x, w) layout that Python fusions rely on).
  std::vector<at::Tensor> saved_scale_inv;
  bool on() const { return recipe != nullptr; }
  /// Whether FP8 GEMMs take a linear's x [m, k] and w [n, k] in `dtype`: E4M3 forward (E5M2 x
  /// E5M2 has no GEMM); per-tensor scaling in bf16, fp16 or fp32, block scaling (cuBLASLt's
  /// block-scaled GEMMs) in bf16 or fp16; m, k, n multiples of 16 (the FP8 GEMM's 16-byte rows,
  /// transposes included); on a CUDA `device`, a GPU that runs them (kernels/fp8/fp8_support.h:
  /// otherwise the casts are emulated, with a warning once per process).
  bool fp8_gemms_fit(int64_t m, int64_t k, int64_t n, at::ScalarType dtype,
                     c10::Device device) const;
  /// The block size code of a GEMM operand under this cast (GemmOperand::block): 0 unless block
  /// scaling runs FP8 GEMMs, else the recipe's dim for a gradient, a weight or an input.
  int64_t gemm_block(bool backward, bool weight) const;
  /// x (in the compute dtype) as the forward's GEMMs take it: the forward's cast of quantizer
  /// `index` (a weight: block scaling's 2-D blocks); FP8 data with gemm_fp8. `rowwise` /
  /// `columnwise`: which uses to fill.
  /// `amax`: max |x| where the kernel that wrote x computed it (ProducedAmax), else undefined;
  /// per-tensor current scaling then casts without its own amax pass.
  /// `act` (gemm_fp8 only, no amax): the operand is act(x) in x's dtype, cast from x in one pass
  /// (a deferred activation, DeferredActivation).
  GemmOperand forward_operand(const at::Tensor& x, size_t index, bool weight, bool rowwise,
                              bool columnwise, const at::Tensor& amax = {},
                              const std::string& act = "") const {
    return operand(x, /*backward=*/false, index, weight, rowwise, columnwise, amax, act);
  }
  /// forward_operand of a tensor x whose dtype may be wider than the GEMMs' `dtype` (a float32
  /// parameter or input under torch.autocast): under a recipe the cast reads x itself, one rounding
  /// to FP8 as te.ops casts (not x rounded to `dtype` first), and the operand computes in `dtype`.
  GemmOperand forward_operand_from(const at::Tensor& x, at::ScalarType dtype, size_t index,
                                   bool weight, bool rowwise, bool columnwise) const;
  /// The tensor a forward cast reads for GEMMs in `dtype`: x itself where a recipe is on and x's
  /// dtype is wider (forward_operand_from's rule), else x in `dtype`.
  at::Tensor cast_source(const at::Tensor& x, at::ScalarType dtype) const;
  /// A gradient as the backward's GEMMs take it (the backward format); `amax` as above.
  GemmOperand backward_operand(const at::Tensor& dy, size_t index, bool rowwise, bool columnwise,
                               const at::Tensor& amax = {}) const {
    return operand(dy, /*backward=*/true, index, /*weight=*/false, rowwise, columnwise, amax);
  }
  /// Whether the casts run on FP8 data with per-tensor current scaling: the casts that take a
  /// producer's amax, and that grouped_operands makes for all groups at once.
  bool takes_produced_amax() const { return gemm_fp8 && recipe->kind == "current"; }
  /// With takes_produced_amax: t [T, k]'s groups of consecutive rows (sizes) as the GEMMs take
  /// them, each cast with the scale of its own amax (as forward_operand / backward_operand cast
  /// one tensor), by one fp8_cast_grouped for all groups; `columnwise`: the transposes too;
  /// `gemm_dtype`: the dtype the GEMMs compute in (default t's; a wider weight's cast under
  /// autocast computes in autocast's).
  std::vector<GemmOperand> grouped_operands(
      const at::Tensor& t, const std::vector<int64_t>& sizes, bool backward, bool columnwise,
      std::optional<at::ScalarType> gemm_dtype = std::nullopt) const;
  /// x as the forward's FP8 GEMM sees it (the forward format); `index`: which of the op's forward
  /// tensors (its quantizer, for delayed scaling); `weight`: a weight (block scaling's 2-D
  /// blocks).
  at::Tensor forward(const at::Tensor& x, size_t index = 0, bool weight = false) const;
  /// A gradient as the backward's FP8 GEMMs see it (the backward format).
  at::Tensor backward(const at::Tensor& dy, size_t index = 0) const;
  /// Whether the weight-gradient GEMM needs its operands cast along the other dim (block
  /// scaling: blocks of 128 rows of one column, as TransformerEngine's column-wise usage).
  bool needs_columnwise() const { return on() && recipe->kind == "block"; }
  /// t [..., n] cast in blocks along its leading (row) dims, the forward's or the backward's
  /// format: the wgrad GEMM's operand under block scaling.
  at::Tensor columnwise(const at::Tensor& t, bool backward) const;

 private:
  GemmOperand operand(const at::Tensor& x, bool backward, size_t index, bool weight, bool rowwise,
                      bool columnwise, const at::Tensor& amax, const std::string& act = "") const;
};

/// The cast for an op's forward now: the autocast's recipe when enabled, else off. Under
/// DelayedScaling, `state` (the op's) is made first where it has none for `counts` (forward,
/// backward) tensors, its histories cut or padded to the recipe's length, and moved to `device`.
Fp8Cast current_fp8_cast(std::shared_ptr<Fp8OpState>* state = nullptr,
                         std::pair<int64_t, int64_t> counts = {0, 0},
                         c10::Device device = c10::kCPU);

}  // namespace fusible::ops

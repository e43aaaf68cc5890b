// The thread's FP8 autocast and the per-op casts.
#include "ops/quantization.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>

#include "kernels/dispatch.h"
#include "kernels/fp8/fp8_support.h"
#include "ops/amax_reduction.h"

namespace fusible::ops {
namespace {

thread_local Fp8Autocast current;
// The states whose forward casts this thread replays (Fp8ReplayGuard): op state -> its replay.
thread_local std::vector<std::pair<const Fp8OpState*, std::shared_ptr<Fp8OpState>>> replaying;
// Where this thread records its delayed casts (Fp8RecordGuard), outermost first.
thread_local std::vector<std::shared_ptr<Fp8Record>> recordings;

void check(const Fp8Autocast& a) {
  if (!a.enabled) return;
  TORCH_CHECK_VALUE(a.recipe != nullptr, "fusible.autocast: enabled without a recipe");
  const auto& k = a.recipe->kind;
  TORCH_CHECK_VALUE(k == "current" || k == "delayed" || k == "block",
                    "fusible.autocast: unknown recipe kind '", k, "'");
  if (k == "block") {
    for (auto d : {a.recipe->x_block_dim, a.recipe->w_block_dim, a.recipe->grad_block_dim}) {
      TORCH_CHECK_VALUE(d == 1 || d == 2,
                        "fusible.autocast: Float8BlockScaling expects block scaling dims 1 or 2, "
                        "got ",
                        d);
    }
  }
  TORCH_CHECK_VALUE(a.recipe->min_tokens >= 0,
                    "fusible.autocast: expected fp8_min_tokens >= 0, got ", a.recipe->min_tokens);
  if (a.recipe->kind == "delayed") {
    TORCH_CHECK_VALUE(a.recipe->amax_history_len >= 1,
                      "fusible.autocast: expected amax_history_len >= 1, got ",
                      a.recipe->amax_history_len);
    TORCH_CHECK_VALUE(
        a.recipe->amax_compute_algo == "max" || a.recipe->amax_compute_algo == "most_recent",
        "fusible.autocast: expected amax_compute_algo 'max' or 'most_recent', got '",
        a.recipe->amax_compute_algo, "'");
  }
  if (a.recipe->amax_reduction_group.size > 1) {
    check_process_group("fusible.autocast", a.recipe->amax_reduction_group);
  }
  for (const auto* f : {&a.recipe->forward_format, &a.recipe->backward_format}) {
    TORCH_CHECK_VALUE(*f == "e4m3" || *f == "e5m2",
                      "fusible.autocast: expected FP8 formats 'e4m3' or 'e5m2', got '", *f, "'");
  }
}

}  // namespace

const Fp8Autocast& fp8_autocast() { return current; }

Fp8Autocast exchange_fp8_autocast(Fp8Autocast autocast) {
  check(autocast);
  std::swap(current, autocast);
  return autocast;
}

Fp8AutocastGuard::Fp8AutocastGuard(bool enabled, std::shared_ptr<const Fp8Recipe> recipe,
                                   bool reduce_amaxes)
    : reduces_(reduce_amaxes && starts_amax_reduction(current, {enabled, recipe})),
      saved_(exchange_fp8_autocast({enabled, std::move(recipe)})),
      exceptions_(std::uncaught_exceptions()) {
  if (!reduces_) return;
  try {  // the previous step's backward amaxes, before this step casts with their scales
    reduce_delayed_amaxes(*current.recipe);
  } catch (...) {
    current = std::move(saved_);  // no destructor runs for a constructor that throws
    throw;
  }
}

Fp8AutocastGuard::~Fp8AutocastGuard() {
  // Not while an exception unwinds: the other ranks may never reach this collective.
  if (reduces_ && std::uncaught_exceptions() == exceptions_) {
    try {
      reduce_delayed_amaxes(*current.recipe);
    } catch (const std::exception& e) {
      TORCH_WARN("fusible: the FP8 autocast's amax reduction failed on exit: ", e.what());
    }
  }
  current = std::move(saved_);
}

namespace {

const DelayedScaling& state_at(const std::vector<DelayedScaling>& states, size_t index) {
  TORCH_CHECK(index < states.size(), "FP8 delayed scaling: no state for tensor ", index);
  return states[index];
}

at::Tensor cast(const Fp8Cast& c, const at::Tensor& x, const std::string& format,
                const std::vector<DelayedScaling>* states, size_t index, int64_t block_dim) {
  if (!c.on() || !x.defined()) return x;
  if (c.recipe->kind == "block") {
    return kernels::fp8_quantize_dequantize_block(x, format, block_dim, /*power_2_scale=*/true);
  }
  if (states == nullptr) return kernels::fp8_quantize_dequantize(x, format, c.recipe->margin);
  const auto& s = state_at(*states, index);
  return kernels::fp8_quantize_dequantize_delayed(x, format, s.amax_history, s.scale,
                                                  c.recipe->margin, c.recipe->amax_compute_algo);
}

std::vector<DelayedScaling> fresh_states(int64_t n, int64_t history_len, c10::Device device) {
  std::vector<DelayedScaling> out;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  for (int64_t i = 0; i < n; ++i) {
    out.push_back({at::zeros({history_len}, opts), at::ones({1}, opts)});
  }
  return out;
}

bool fits(const std::vector<DelayedScaling>& states, int64_t n, int64_t len) {
  if (static_cast<int64_t>(states.size()) != n) return false;
  for (const auto& s : states) {
    if (s.amax_history.size(0) != len) return false;
  }
  return true;
}

// Whether a state serves an op that casts counts.first / counts.second tensors per direction
// (whatever its history length: te keeps the scales and entries when the length changes).
bool serves(const std::shared_ptr<Fp8OpState>& s, std::pair<int64_t, int64_t> counts) {
  return s && static_cast<int64_t>(s->forward.size()) == counts.first &&
         static_cast<int64_t>(s->backward.size()) == counts.second;
}

// The states with histories of length len: the newest entries kept (cut to len, or padded with
// zeros), the scales as they are. (te cuts to the first entries of its layout, which after its
// roll are the current step's slot and the oldest: we keep the newest on purpose; docs/fp8.md.)
std::vector<DelayedScaling> with_length(const std::vector<DelayedScaling>& states, int64_t len) {
  std::vector<DelayedScaling> out;
  for (const auto& s : states) {
    const int64_t have = s.amax_history.size(0);
    auto history = have >= len ? s.amax_history.narrow(0, 0, len).clone()
                               : at::constant_pad_nd(s.amax_history, {0, len - have}, 0);
    out.push_back({std::move(history), s.scale});
  }
  return out;
}

// A state loaded (or made) elsewhere follows the op's tensors to their device.
void move_to(std::vector<DelayedScaling>& states, c10::Device device) {
  for (auto& s : states) {
    if (s.amax_history.device() != device) {
      s = {s.amax_history.to(device), s.scale.to(device)};
    }
  }
}

// A format change between steps (another recipe, or a checkpoint of another format): each scale
// computed from an amax (a history with an entry above 0) is made the new format's, fmax_new /
// fmax_old times itself, as the update would have computed it; scales still at their start stay.
// Without it the first cast after a HYBRID -> E4M3 switch would saturate nearly every value.
// In place: a captured CUDA graph keeps reading the same scale tensors.
void rescale_to_format(std::vector<DelayedScaling>& states, std::string& format,
                       const std::string& wanted) {
  if (format == wanted) return;
  if (!format.empty()) {
    const double ratio = kernels::fp8_max("FP8 delayed scaling", wanted) /
                         kernels::fp8_max("FP8 delayed scaling", format);
    const at::NoGradGuard no_grad;
    for (auto& d : states) {
      const auto updated = d.amax_history.amax().gt(0).to(at::kFloat);
      d.scale.mul_(updated.mul(ratio - 1.0).add_(1.0));
    }
  }
  format = wanted;
}

// The delayed cast of c's state `index`, through its period under an amax reduction
// (ops/amax_reduction.h). A replayed forward's states are throwaway copies (Fp8ReplayGuard): they
// cast as they are.
std::optional<PeriodCast> period_cast(const Fp8Cast& c, bool backward, size_t index) {
  if (!c.state) return std::nullopt;
  if (!backward) {
    for (const auto& r : replaying) {
      if (r.second == c.state) return std::nullopt;
    }
  }
  return PeriodCast(*c.recipe, backward ? c.state->backward : c.state->forward, index, backward);
}

// The states (and index) a cast uses: its period's under an amax reduction.
const std::vector<DelayedScaling>* cast_states(const std::optional<PeriodCast>& period,
                                               const std::vector<DelayedScaling>* own) {
  return period && own ? &period->states(*own) : own;
}

}  // namespace

at::Tensor Fp8Cast::forward(const at::Tensor& x, size_t index, bool weight) const {
  if (!on() || !x.defined()) return x;
  const auto period = period_cast(*this, /*backward=*/false, index);
  auto y = cast(
      *this, x, recipe->forward_format, cast_states(period, state ? &state->forward : nullptr),
      period ? period->index(index) : index, weight ? recipe->w_block_dim : recipe->x_block_dim);
  if (period) period->finish();
  return y;
}

at::Tensor Fp8Cast::backward(const at::Tensor& dy, size_t index) const {
  if (!on() || !dy.defined()) return dy;
  const auto period = period_cast(*this, /*backward=*/true, index);
  auto y = cast(*this, dy, recipe->backward_format,
                cast_states(period, state ? &state->backward : nullptr),
                period ? period->index(index) : index, recipe->grad_block_dim);
  if (period) period->finish();
  return y;
}

at::Tensor Fp8Cast::columnwise(const at::Tensor& t, bool backward) const {
  TORCH_CHECK(needs_columnwise() && t.defined(), "FP8: a column-wise cast needs block scaling");
  const auto& format = backward ? recipe->backward_format : recipe->forward_format;
  const auto rows = t.reshape({-1, t.size(-1)});
  // Row-wise 1x128 blocks of the transpose are 128x1 blocks of t.
  const auto q =
      kernels::fp8_quantize_dequantize_block(rows.t(), format, 1, /*power_2_scale=*/true);
  return q.t().contiguous().reshape(t.sizes());
}

bool Fp8Cast::fp8_gemms_fit(int64_t m, int64_t k, int64_t n, at::ScalarType dtype,
                            c10::Device device) const {
  if (!on() || recipe->forward_format != "e4m3") return false;
  const bool block = recipe->kind == "block";
  if (dtype != at::kBFloat16 && dtype != at::kHalf && (block || dtype != at::kFloat)) return false;
  // Block scaling: 1x128 or 128x128 blocks, never 128x128 on both sides of a GEMM (fprop and
  // dgrad pair the weight with x and the gradient, wgrad pairs x with the gradient).
  const auto two = [&](int64_t d) { return d == 2; };
  if (block &&
      ((two(recipe->w_block_dim) && (two(recipe->x_block_dim) || two(recipe->grad_block_dim))) ||
       (two(recipe->x_block_dim) && two(recipe->grad_block_dim)))) {
    return false;
  }
  if (!(m > 0 && m % 16 == 0 && k % 16 == 0 && n % 16 == 0)) return false;
  if (device.is_cuda()) {
    const auto cc = kernels::cuda_capability(device.index());
    const auto support = kernels::fp8_gemm_support(cc.first, cc.second, block);
    if (!support.first) {
      TORCH_WARN_ONCE("fusible: ", support.second, ": the FP8 recipe's casts are emulated (cast ",
                      "to FP8 and back) and the GEMMs run in ", dtype);
      return false;
    }
  }
  return true;
}

int64_t Fp8Cast::gemm_block(bool backward, bool weight) const {
  if (!gemm_fp8 || recipe->kind != "block") return 0;
  return backward ? recipe->grad_block_dim : weight ? recipe->w_block_dim : recipe->x_block_dim;
}

namespace {

// act: "none", or the activation applied to x on the way in (the casts' act).
GemmOperand fp8_data(const Fp8Cast& c, const at::Tensor& x, const std::string& format,
                     const std::vector<DelayedScaling>* states, size_t index, bool transpose,
                     const at::Tensor& amax, const std::string& act) {
  GemmOperand o;
  o.dtype = x.scalar_type();
  at::Tensor data_t;
  if (states == nullptr && amax.defined()) {
    std::tie(o.rowwise, data_t, o.scale_inv) =
        kernels::fp8_cast_with_amax(x, format, amax, c.recipe->margin, transpose);
  } else if (states == nullptr) {
    std::tie(o.rowwise, data_t, o.scale_inv) =
        kernels::fp8_cast(x, format, c.recipe->margin, transpose, act);
  } else {
    const auto& s = state_at(*states, index);
    std::tie(o.rowwise, data_t, o.scale_inv) =
        kernels::fp8_cast_delayed(x, format, s.amax_history, s.scale, c.recipe->margin,
                                  c.recipe->amax_compute_algo, transpose, act);
  }
  if (transpose) o.columnwise = data_t;
  o.columnwise_scale_inv = o.scale_inv;  // one per-tensor scale for both uses
  return o;
}

// Block scaling: the rows and the transpose cast in their own blocks, each with its scales.
GemmOperand fp8_block_data(const at::Tensor& x, const std::string& format, int64_t block,
                           bool rowwise, bool columnwise, const std::string& act) {
  GemmOperand o;
  o.dtype = x.scalar_type();
  o.block = block;
  auto [data, scale_inv, data_t, scale_inv_t] =
      kernels::fp8_cast_block(x, format, block, rowwise, columnwise, act);
  if (rowwise) {
    o.rowwise = data;
    o.scale_inv = scale_inv;
  }
  if (columnwise) {
    o.columnwise = data_t;
    o.columnwise_scale_inv = scale_inv_t;
  }
  return o;
}

}  // namespace

GemmOperand Fp8Cast::operand(const at::Tensor& x, bool backward, size_t index, bool weight,
                             bool rowwise, bool columnwise, const at::Tensor& amax,
                             const std::string& act) const {
  TORCH_CHECK(act.empty() || (gemm_fp8 && !amax.defined()),
              "FP8 cast: an activation on load needs FP8 GEMMs and no given amax");
  const std::string cast_act = act.empty() ? "none" : act;
  if (gemm_fp8) {
    const auto& format = backward ? recipe->backward_format : recipe->forward_format;
    if (recipe->kind == "block") {
      return fp8_block_data(x, format, gemm_block(backward, weight), rowwise, columnwise, cast_act);
    }
    const auto* states = state ? (backward ? &state->backward : &state->forward) : nullptr;
    const auto period = period_cast(*this, backward, index);
    auto o = fp8_data(*this, x, format, cast_states(period, states),
                      period ? period->index(index) : index, columnwise, amax, cast_act);
    if (period) period->finish();
    return o;
  }
  GemmOperand o;
  o.dtype = x.scalar_type();
  // One cast serves both uses but under 1x128 block scaling (a delayed state takes one cast per
  // use): the wgrad GEMM reads the other dim, in blocks of its own. 128x128 blocks are the same
  // blocks either way, as TransformerEngine's 2-D block scaling.
  const bool one_d = needs_columnwise() && (backward ? recipe->grad_block_dim
                                            : weight ? recipe->w_block_dim
                                                     : recipe->x_block_dim) == 1;
  const bool own_columnwise = columnwise && one_d;
  if (rowwise || (columnwise && !own_columnwise)) {
    o.rowwise = backward ? this->backward(x, index) : forward(x, index, weight);
  }
  if (columnwise) o.columnwise = own_columnwise ? this->columnwise(x, backward) : o.rowwise;
  if (!rowwise) o.rowwise = at::Tensor();
  return o;
}

at::Tensor Fp8Cast::cast_source(const at::Tensor& x, at::ScalarType dtype) const {
  if (x.scalar_type() == dtype) return x;
  const bool wider = at::isFloatingType(x.scalar_type()) &&
                     at::elementSize(x.scalar_type()) > at::elementSize(dtype);
  return on() && wider ? x : x.to(dtype);
}

GemmOperand Fp8Cast::forward_operand_from(const at::Tensor& x, at::ScalarType dtype, size_t index,
                                          bool weight, bool rowwise, bool columnwise) const {
  auto o = forward_operand(cast_source(x, dtype), index, weight, rowwise, columnwise);
  if (o.dtype == dtype) return o;
  o.dtype = dtype;  // cast from a wider x: the GEMMs still compute in dtype
  if (!o.fp8()) {   // emulated: the cast's values, then the dtype the GEMM computes in
    const bool shared = o.rowwise.defined() && o.columnwise.is_same(o.rowwise);
    if (o.rowwise.defined()) o.rowwise = o.rowwise.to(dtype);
    if (o.columnwise.defined()) o.columnwise = shared ? o.rowwise : o.columnwise.to(dtype);
  }
  return o;
}

std::vector<GemmOperand> Fp8Cast::grouped_operands(const at::Tensor& t,
                                                   const std::vector<int64_t>& sizes, bool backward,
                                                   bool columnwise,
                                                   std::optional<at::ScalarType> gemm_dtype) const {
  TORCH_CHECK(takes_produced_amax(),
              "Fp8Cast::grouped_operands: expected per-tensor current scaling on FP8 data, got "
              "recipe kind '",
              recipe ? recipe->kind : "none", "' with gemm_fp8=", gemm_fp8);
  const auto& format = backward ? recipe->backward_format : recipe->forward_format;
  const auto [data, data_t, scale_inv] =
      kernels::fp8_cast_grouped(t, sizes, format, recipe->margin, columnwise);
  const int64_t k = t.size(1);
  // Each group's scale_inv 16 bytes apart: cuBLASLt takes only 16-byte aligned scale pointers
  // (fp8_gemm would copy each one otherwise, a launch per GEMM).
  const auto scales = scale_inv.view({-1, 1}).expand({-1, 4}).contiguous();
  std::vector<GemmOperand> out(sizes.size());
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    auto& o = out[g];
    const int64_t m = sizes[g];
    o.dtype = gemm_dtype.value_or(t.scalar_type());
    o.rowwise = data.narrow(0, start, m);
    o.scale_inv = o.columnwise_scale_inv = scales[static_cast<int64_t>(g)].narrow(0, 0, 1);
    if (columnwise) o.columnwise = data_t.narrow(0, start * k, m * k).view({k, m});
    start += m;
  }
  return out;
}

namespace {
std::atomic<bool> amax_handoff{true};
}  // namespace

bool fp8_amax_handoff() { return amax_handoff.load(std::memory_order_relaxed); }
void set_fp8_amax_handoff(bool on) { amax_handoff.store(on, std::memory_order_relaxed); }

namespace {

// Into every active record not holding it yet: state `key`'s forward histories and scales as
// `now` holds them (the state itself, or its replay), before the op's first cast in the record.
void record_casts(const std::shared_ptr<Fp8OpState>& key, const Fp8OpState& now,
                  std::pair<int64_t, int64_t> counts) {
  for (auto& r : recordings) {
    const bool seen = std::any_of(r->ops.begin(), r->ops.end(),
                                  [&](const OpFp8State& o) { return o.state == key; });
    if (seen) continue;
    std::vector<DelayedScaling> copies;
    for (const auto& d : now.forward) copies.push_back({d.amax_history.clone(), d.scale.clone()});
    r->ops.push_back({key, counts});
    r->forward.push_back(std::move(copies));
  }
}

}  // namespace

Fp8Cast current_fp8_cast(std::shared_ptr<Fp8OpState>* state, std::pair<int64_t, int64_t> counts,
                         c10::Device device) {
  const auto& a = fp8_autocast();
  if (!a.enabled) return {};
  if (a.recipe->kind != "delayed") return {a.recipe, nullptr};
  TORCH_CHECK(state != nullptr, "FP8 delayed scaling: this op keeps no quantizer state");
  auto& s = *state;
  // A replayed forward casts from its replay's copies and leaves the op's own state as it is.
  for (auto it = replaying.rbegin(); s && it != replaying.rend(); ++it) {
    if (it->first != s.get()) continue;
    record_casts(s, *it->second, counts);
    return {a.recipe, it->second};
  }
  // The state outlives this call: never inference tensors, which a later training step could not
  // update (a forward under torch.inference_mode may make or move it).
  std::optional<c10::InferenceMode> not_inference;
  if (c10::InferenceMode::is_enabled()) not_inference.emplace(false);
  const auto len = a.recipe->amax_history_len;
  if (!serves(s, counts)) {
    auto fresh = std::make_shared<Fp8OpState>();
    fresh->forward = fresh_states(counts.first, len, device);
    fresh->backward = fresh_states(counts.second, len, device);
    fresh->forward_format = a.recipe->forward_format;
    fresh->backward_format = a.recipe->backward_format;
    s = std::move(fresh);
  } else if (!fits(s->forward, counts.first, len) || !fits(s->backward, counts.second, len)) {
    // Another history length: each tensor's scale and newest entries kept (with_length).
    auto resized = std::make_shared<Fp8OpState>();
    resized->forward = with_length(s->forward, len);
    resized->backward = with_length(s->backward, len);
    resized->forward_format = s->forward_format;
    resized->backward_format = s->backward_format;
    s = std::move(resized);
  }
  move_to(s->forward, device);
  move_to(s->backward, device);
  rescale_to_format(s->forward, s->forward_format, a.recipe->forward_format);
  rescale_to_format(s->backward, s->backward_format, a.recipe->backward_format);
  record_casts(s, *s, counts);
  return {a.recipe, s};
}

namespace {

// The state a replayed forward casts with: `forward` (throwaway copies the casts may update) and
// the op's own backward states (the same tensors: the backward records as usual).
std::shared_ptr<Fp8OpState> replay_state(const Fp8OpState& real,
                                         std::vector<DelayedScaling> forward) {
  auto r = std::make_shared<Fp8OpState>();
  r->forward = std::move(forward);
  r->backward = real.backward;
  r->forward_format = real.forward_format;
  r->backward_format = real.backward_format;
  return r;
}

}  // namespace

std::unique_ptr<Fp8ReplayGuard> Fp8Record::replay() const {
  std::vector<std::pair<const Fp8OpState*, std::shared_ptr<Fp8OpState>>> states;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::vector<DelayedScaling> copies;
    for (const auto& d : forward[i]) copies.push_back({d.amax_history.clone(), d.scale.clone()});
    states.emplace_back(ops[i].state.get(), replay_state(*ops[i].state, std::move(copies)));
  }
  return std::make_unique<Fp8ReplayGuard>(std::move(states));
}

Fp8RecordGuard::Fp8RecordGuard(std::shared_ptr<Fp8Record> record) {
  recordings.push_back(std::move(record));
}

Fp8RecordGuard::~Fp8RecordGuard() { recordings.pop_back(); }

std::string recipe_key(const Fp8Recipe* r) {
  if (r == nullptr) return "";
  std::ostringstream out;
  out << std::setprecision(17) << r->kind << ';' << r->forward_format << ';' << r->backward_format
      << ';' << r->margin << ';' << r->amax_history_len << ';' << r->amax_compute_algo << ';'
      << r->x_block_dim << ';' << r->w_block_dim << ';' << r->grad_block_dim << ';' << r->min_tokens
      << ';' << r->amax_reduction_group.size << ';' << r->amax_reduction_group.rank << ';'
      << r->amax_reduction_device << ';' << r->amax_reduction_group.name;
  return out.str();
}

std::shared_ptr<const Fp8Recipe> recipe_from_key(const std::string& key) {
  if (key.empty()) return nullptr;
  std::istringstream in(key);
  auto r = std::make_shared<Fp8Recipe>();
  char sep[8] = {};  // the ';' after each number but the last
  std::getline(in, r->kind, ';');
  std::getline(in, r->forward_format, ';');
  std::getline(in, r->backward_format, ';');
  in >> r->margin >> sep[0] >> r->amax_history_len >> sep[1];
  std::getline(in, r->amax_compute_algo, ';');
  auto& g = r->amax_reduction_group;
  in >> r->x_block_dim >> sep[2] >> r->w_block_dim >> sep[3] >> r->grad_block_dim >> sep[4] >>
      r->min_tokens >> sep[5] >> g.size >> sep[6] >> g.rank >> sep[7];
  std::string device;
  std::getline(in, device, ';');
  const bool ok = !in.fail() && std::all_of(sep, sep + 8, [](char c) { return c == ';'; });
  TORCH_CHECK_VALUE(ok, "fusible: '", key, "' is not an FP8 recipe key");
  try {
    r->amax_reduction_device = c10::Device(device);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, "fusible: '", key, "' is not an FP8 recipe key (device '", device,
                      "')");
  }
  const auto rest = in.tellg();  // the group's name: the rest, whatever its characters
  g.name = rest < 0 ? "" : key.substr(static_cast<size_t>(rest));
  check({true, r});
  return r;
}

at::Tensor delayed_forward_scales(const std::vector<OpFp8State>& ops, c10::Device device) {
  std::vector<at::Tensor> scales;
  for (const auto& op : ops) {
    for (int64_t j = 0; j < op.counts.first; ++j) {
      // The op's scales where its forward keeps its state, else a fresh state's 1.
      scales.push_back(serves(op.state, op.counts)
                           ? op.state->forward[j].scale.to(device)
                           : at::ones({1}, at::dtype(at::kFloat).device(device)));
    }
  }
  if (scales.empty()) return at::empty({0}, at::dtype(at::kFloat).device(device));
  return at::cat(scales);
}

Fp8ReplayGuard::Fp8ReplayGuard(const std::vector<OpFp8State>& ops, const at::Tensor& scales) {
  int64_t total = 0;
  for (const auto& op : ops) total += op.counts.first;
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == total,
              "FP8 delayed scaling: a replay expects ", total, " forward scales, got shape ",
              scales.sizes());
  int64_t offset = 0;
  for (const auto& op : ops) {
    if (op.state) {
      std::vector<DelayedScaling> forward;
      for (int64_t j = 0; j < op.counts.first; ++j) {
        // Its own history and a copy of the scale: the cast updates both in place.
        const auto& real = state_at(op.state->forward, j);
        forward.push_back({at::zeros_like(real.amax_history),
                           scales.narrow(0, offset + j, 1).to(real.scale.device()).clone()});
      }
      replay_.emplace_back(op.state.get(), replay_state(*op.state, std::move(forward)));
    }
    offset += op.counts.first;
  }
  saved_ = replaying;
  replaying.insert(replaying.end(), replay_.begin(), replay_.end());
}

Fp8ReplayGuard::Fp8ReplayGuard(
    std::vector<std::pair<const Fp8OpState*, std::shared_ptr<Fp8OpState>>> replay)
    : replay_(std::move(replay)), saved_(replaying) {
  replaying.insert(replaying.end(), replay_.begin(), replay_.end());
}

Fp8ReplayGuard::~Fp8ReplayGuard() { replaying = std::move(saved_); }

}  // namespace fusible::ops

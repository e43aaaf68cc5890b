// fusible::sequential_call and fusible::sequential_call_backward: C++ kernels and autograd formula,
// so a compiled graph runs a fusible Sequential with no Python on the per-call path (their fake
// kernels, used while tracing, are registered from Python).
#include "fuser/compiled_call.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/autograd_keys.h"
#include "ops/quantization.h"

namespace fusible::fuser {
namespace {

struct Registry {
  std::mutex mutex;
  SequentialResolver resolver;
  std::unordered_map<int64_t, std::weak_ptr<Sequential>> engines;
};

// Never destroyed: the resolver may hold a Python callable, which must not be released after the
// interpreter is gone.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

std::shared_ptr<Sequential> engine(int64_t handle) {
  auto& r = registry();
  SequentialResolver resolver;
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.engines.find(handle);
    if (it != r.engines.end()) {
      if (auto seq = it->second.lock()) return seq;
    }
    resolver = r.resolver;
  }
  TORCH_CHECK(resolver, "fusible::sequential_call: no Sequential is registered for handle ",
              handle);
  auto seq = resolver(handle);  // outside the lock: it may run Python, which takes the GIL
  TORCH_CHECK(seq, "fusible::sequential_call: handle ", handle, " names no Sequential");
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.engines[handle] = seq;
  return seq;
}

constexpr char kNameSeparator = '\x1f';  // joins the channel names (the schema has no str[])

Sequential::NamedTensors named_inputs(c10::string_view names, at::TensorList named) {
  Sequential::NamedTensors out;
  if (named.empty()) return out;
  size_t start = 0;
  for (const auto& t : named) {
    const auto end = std::min(names.find(kNameSeparator, start), names.size());
    out.emplace_back(std::string(names.substr(start, end - start)), t);
    start = end + 1;
  }
  return out;
}

// An op's outputs may alias neither an input nor each other: those that do are copied.
std::vector<at::Tensor> owned(std::vector<at::Tensor> outputs,
                              std::initializer_list<at::TensorList> inputs) {
  std::vector<const void*> seen;
  const auto storage = [](const at::Tensor& t) {
    return t.defined() && t.numel() > 0 ? t.storage().unsafeGetStorageImpl() : nullptr;
  };
  for (const auto& group : inputs) {
    for (const auto& t : group) {
      if (const void* s = storage(t)) seen.push_back(s);
    }
  }
  for (auto& t : outputs) {
    const void* s = storage(t);
    if (s == nullptr) continue;
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) {
      t = t.clone();
    } else {
      seen.push_back(s);
    }
  }
  return outputs;
}

// The FP8 recipe a call was compiled for (its key; "" for none), checked against the autocast
// it runs under: a compiled graph fixes its recipe when traced.
std::shared_ptr<const ops::Fp8Recipe> compiled_recipe(c10::string_view fp8) {
  const auto& a = ops::fp8_autocast();
  const auto now = ops::recipe_key(a.enabled ? a.recipe.get() : nullptr);
  TORCH_CHECK(now == fp8, "fusible::sequential_call: compiled under FP8 recipe '", fp8,
              "' but called under '", now,
              "' (enter fusible.autocast on the thread that calls the compiled model)");
  return ops::recipe_from_key(std::string(fp8));
}

bool is_delayed(const std::shared_ptr<const ops::Fp8Recipe>& recipe) {
  return recipe && recipe->kind == "delayed";
}

// The delayed-scaling states of the Sequential's ops, in op order.
std::vector<ops::OpFp8State> fp8_states(Sequential& seq) {
  std::vector<ops::OpFp8State> out;
  for (const auto& child : seq.children()) {
    const auto op = std::dynamic_pointer_cast<ops::FusibleOperation>(child);
    if (!op) continue;
    for (const auto& basic : op->basic_ops()) {
      out.push_back({basic->fp8_state(), basic->num_quantizers()});
    }
  }
  return out;
}

// While alive: torch.autocast on for `device`'s type with the dtype a call was traced under ("":
// the thread's own state). A compiled graph runs its autocast regions as explicit casts, not as
// the autocast state, so the op sets the state the eager call would have seen. Its cast cache
// stays off: parameters change in place between calls.
class TorchAutocastGuard {
 public:
  TorchAutocastGuard(c10::string_view dtype, const at::Device& device) {
    if (dtype.empty()) return;
    type_ = device.type();
    was_enabled_ = at::autocast::is_autocast_enabled(type_);
    was_dtype_ = at::autocast::get_autocast_dtype(type_);
    was_caching_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, parse(dtype));
    at::autocast::set_autocast_cache_enabled(false);
    active_ = true;
  }
  ~TorchAutocastGuard() {
    if (!active_) return;
    at::autocast::set_autocast_enabled(type_, was_enabled_);
    at::autocast::set_autocast_dtype(type_, was_dtype_);
    at::autocast::set_autocast_cache_enabled(was_caching_);
  }
  TorchAutocastGuard(const TorchAutocastGuard&) = delete;
  TorchAutocastGuard& operator=(const TorchAutocastGuard&) = delete;

 private:
  static at::ScalarType parse(c10::string_view dtype) {
    if (dtype == "bfloat16") return at::kBFloat16;
    if (dtype == "float16") return at::kHalf;
    if (dtype == "float32") return at::kFloat;
    TORCH_CHECK(false, "fusible::sequential_call: autocast dtype '", dtype,
                "' is not one of bfloat16, float16, float32");
  }
  bool active_ = false, was_enabled_ = false, was_caching_ = true;
  at::DeviceType type_ = at::kCPU;
  at::ScalarType was_dtype_ = at::kFloat;
};

// A call's tensors, [input, extras..., named..., params...] (one list the schema never leaves
// empty: AOTInductor passes an empty tensor list as None), split.
struct CallTensors {
  at::Tensor input;
  std::vector<at::Tensor> extras, named, params;
  CallTensors(at::TensorList tensors, int64_t num_extras, int64_t num_named) {
    TORCH_CHECK(!tensors.empty() && num_extras >= 0 && num_named >= 0 &&
                    1 + num_extras + num_named <= static_cast<int64_t>(tensors.size()),
                "fusible::sequential_call: ", tensors.size(), " tensors cannot hold an input, ",
                num_extras, " extra and ", num_named, " named inputs");
    input = tensors[0];
    extras = tensors.slice(1, num_extras).vec();
    named = tensors.slice(1 + num_extras, num_named).vec();
    params = tensors.slice(1 + num_extras + num_named).vec();
  }
};

// The default generator of a device (a training-mode Dropout's), whose state a call saves so its
// recomputation draws the same masks.
at::Generator generator_of(const at::Device& device) {
  return at::globalContext().defaultGenerator(device);
}

std::vector<at::Tensor> sequential_call(int64_t handle, at::TensorList tensors, int64_t num_extras,
                                        int64_t num_named, c10::string_view names,
                                        c10::string_view fp8, bool replay_rng,
                                        c10::string_view autocast, int64_t /*call_id*/) {
  auto seq = engine(handle);
  const CallTensors t(tensors, num_extras, num_named);
  const TorchAutocastGuard amp(autocast, t.input.device());
  const auto recipe = compiled_recipe(fp8);
  // Delayed scaling: the scales this forward casts with, for the backward's recomputation.
  const auto scales = is_delayed(recipe)
                          ? ops::delayed_forward_scales(fp8_states(*seq), t.input.device())
                          : at::Tensor();
  at::Tensor rng_state;  // likewise the generator's state its Dropout draws from
  if (replay_rng) {
    auto gen = generator_of(t.input.device());
    const std::lock_guard<std::mutex> lock(gen.mutex());
    rng_state = gen.get_state();
  }
  const at::NoGradGuard no_grad;
  auto outputs = seq->run(t.input, t.extras, named_inputs(names, t.named), t.params).outputs;
  outputs = owned(std::move(outputs), {tensors});
  if (scales.defined()) outputs.push_back(scales);
  if (rng_state.defined()) outputs.push_back(rng_state);
  return outputs;
}

// While alive: the generator of `device` at `state` (the forward's), its own state restored after,
// so a recomputation draws the forward's masks and leaves the random sequence as it was.
class RngReplay {
 public:
  RngReplay(const at::Device& device, const at::Tensor& state) : gen_(generator_of(device)) {
    const std::lock_guard<std::mutex> lock(gen_.mutex());
    saved_ = gen_.get_state();
    gen_.set_state(state);
  }
  ~RngReplay() {
    const std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(saved_);
  }
  RngReplay(const RngReplay&) = delete;
  RngReplay& operator=(const RngReplay&) = delete;

 private:
  at::Generator gen_;
  at::Tensor saved_;
};

// Recomputes the call with autograd on and differentiates it: a compiled graph keeps only the
// call's inputs between forward and backward. One gradient per tensor of the call.
std::vector<at::Tensor> sequential_call_backward(int64_t handle, at::TensorList tensors,
                                                 int64_t num_extras, int64_t num_named,
                                                 c10::string_view names,
                                                 at::TensorList grad_outputs, c10::string_view fp8,
                                                 const std::optional<at::Tensor>& fp8_scales,
                                                 const std::optional<at::Tensor>& rng_state,
                                                 c10::string_view autocast, int64_t /*call_id*/) {
  auto seq = engine(handle);
  TORCH_CHECK(!tensors.empty(), "fusible::sequential_call_backward: no tensors");
  // The recomputation runs under the forward's autocast; the differentiation after it does not
  // (as an eager backward runs outside the autocast region).
  std::optional<TorchAutocastGuard> amp;
  amp.emplace(autocast, tensors[0].device());
  std::optional<RngReplay> rng;
  if (rng_state.has_value() && rng_state->defined()) rng.emplace(tensors[0].device(), *rng_state);
  // The forward's recipe, and under delayed scaling its scales: the recomputation casts as the
  // forward did, and only the backward's casts advance the histories.
  const auto recipe = ops::recipe_from_key(std::string(fp8));
  // The user's autocast reduces amaxes across ranks; this inner scope does not.
  const ops::Fp8AutocastGuard fp8_autocast(recipe != nullptr, recipe, /*reduce_amaxes=*/false);
  std::optional<ops::Fp8ReplayGuard> replay;
  if (is_delayed(recipe)) {
    TORCH_CHECK(fp8_scales.has_value() && fp8_scales->defined(),
                "fusible::sequential_call_backward: delayed scaling needs the forward's scales");
    replay.emplace(fp8_states(*seq), *fp8_scales);
  }
  std::vector<at::Tensor> leaves;
  for (const auto& t : tensors) leaves.push_back(t.detach().requires_grad_(t.is_floating_point()));
  const CallTensors t(leaves, num_extras, num_named);
  std::vector<at::Tensor> grads(leaves.size());
  {
    const AutogradKeysOn with_autograd;  // a kernel may run below autograd; this recomputes
    const at::AutoGradMode grad_mode(true);
    const auto outputs =
        seq->run(t.input, t.extras, named_inputs(names, t.named), t.params).outputs;
    amp.reset();
    TORCH_CHECK(outputs.size() == grad_outputs.size(),
                "fusible::sequential_call_backward: ", grad_outputs.size(),
                " output gradients for ", outputs.size(), " outputs");
    std::vector<at::Tensor> outs, gouts, wanted;
    std::vector<size_t> wanted_index;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(outputs[i]);
        gouts.push_back(grad_outputs[i]);
      }
    }
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (leaves[i].requires_grad()) {
        wanted.push_back(leaves[i]);
        wanted_index.push_back(i);
      }
    }
    if (!outs.empty() && !wanted.empty()) {
      auto g = torch::autograd::grad(outs, wanted, gouts, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < g.size(); ++j) grads[wanted_index[j]] = std::move(g[j]);
    }
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = at::zeros_like(leaves[i]);
  }
  // A gradient may be an incoming one passed straight through (an add's): copied.
  return owned(std::move(grads), {tensors, grad_outputs});
}

// The autograd formula: the backward op on the saved inputs (the graph keeps nothing else).
struct SequentialCallAutograd : public torch::autograd::Function<SequentialCallAutograd> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t handle, at::TensorList tensors,
                                                int64_t num_extras, int64_t num_named,
                                                c10::string_view names, c10::string_view fp8,
                                                bool replay_rng, c10::string_view autocast,
                                                int64_t call_id) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fusible::sequential_call", "")
                               .typed<decltype(sequential_call)>();
    ctx->saved_data["handle"] = handle;
    ctx->saved_data["names"] = std::string(names);
    ctx->saved_data["fp8"] = std::string(fp8);
    ctx->saved_data["autocast"] = std::string(autocast);
    ctx->saved_data["call_id"] = call_id;
    ctx->saved_data["extras"] = num_extras;
    ctx->saved_data["named"] = num_named;
    auto saved = tensors.vec();
    auto outputs = [&] {
      const at::AutoDispatchBelowADInplaceOrView below_autograd;  // apply() only turns grad off
      return op.call(handle, tensors, num_extras, num_named, names, fp8, replay_rng, autocast,
                     call_id);
    }();
    // The forward's delayed scales and generator state (the last outputs): saved, and no gradient
    // flows through them.
    const bool delayed = is_delayed(ops::recipe_from_key(std::string(fp8)));
    const auto extra = static_cast<int64_t>(delayed) + static_cast<int64_t>(replay_rng);
    std::vector<at::Tensor> kept(outputs.end() - extra, outputs.end());
    saved.insert(saved.end(), kept.begin(), kept.end());
    if (!kept.empty()) ctx->mark_non_differentiable(kept);
    ctx->saved_data["delayed"] = delayed;
    ctx->saved_data["replay_rng"] = replay_rng;
    ctx->save_for_backward(saved);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fusible::sequential_call_backward", "")
                               .typed<decltype(sequential_call_backward)>();
    auto saved = ctx->get_saved_variables();
    const auto take_last = [&](const char* flag) -> std::optional<at::Tensor> {
      if (!ctx->saved_data[flag].toBool()) return std::nullopt;
      auto t = saved.back();
      saved.pop_back();
      grad_outputs.pop_back();
      return t;
    };
    const auto rng_state = take_last("replay_rng");  // outputs [..., scales, rng state]
    const auto scales = take_last("delayed");
    auto grads =
        op.call(ctx->saved_data["handle"].toInt(), saved, ctx->saved_data["extras"].toInt(),
                ctx->saved_data["named"].toInt(), ctx->saved_data["names"].toStringRef(),
                grad_outputs, ctx->saved_data["fp8"].toStringRef(), scales, rng_state,
                ctx->saved_data["autocast"].toStringRef(), ctx->saved_data["call_id"].toInt());
    // One slot per forward argument, a tensor list's flattened: none for the other arguments.
    torch::autograd::variable_list out{at::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    out.resize(out.size() + 7);
    return out;
  }
};

std::vector<at::Tensor> sequential_call_autograd(int64_t handle, at::TensorList tensors,
                                                 int64_t num_extras, int64_t num_named,
                                                 c10::string_view names, c10::string_view fp8,
                                                 bool replay_rng, c10::string_view autocast,
                                                 int64_t call_id) {
  return SequentialCallAutograd::apply(handle, tensors, num_extras, num_named, names, fp8,
                                       replay_rng, autocast, call_id);
}

}  // namespace

int64_t delayed_scale_count(Sequential& seq) {
  int64_t n = 0;
  for (const auto& op : fp8_states(seq)) n += op.counts.first;
  return n;
}

void set_sequential_resolver(SequentialResolver resolver) {
  auto& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.resolver = std::move(resolver);
  r.engines.clear();
}

void forget_sequential(int64_t handle) {
  auto& r = registry();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.engines.erase(handle);
}

}  // namespace fusible::fuser

TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // The whole call of the Sequential named by handle: [y, public extra outputs]. tensors: [input,
  // num_extras extra inputs, num_named channel inputs, the parameters]; names: the channel names,
  // joined by '\x1f'. fp8: the key of the FP8 recipe it was compiled under ("" for none;
  // ops::recipe_key), which must be the autocast's when it runs; under delayed scaling an output
  // after the call's is the scales the forward cast with (its backward replays them).
  // replay_rng (a training-mode Dropout): the last output is the state of the input device's
  // generator before the call, from which the backward's recomputation draws the same masks.
  // autocast: the torch.autocast dtype of the input's device type when it was traced ("" when
  // off; bfloat16, float16 or float32), which the call runs under, as the eager call did.
  // Used by torch.compile and torch.export (its fake kernel comes from Python).
  // call_id: distinct for each call in a traced graph (unused here): two calls on the same tensors
  // may differ (a Dropout's masks, a delayed-scaling history that advances per call), and the
  // distinct argument keeps a graph pass (AOTAutograd's CSE) from merging them.
  m.def(
      "sequential_call(int handle, Tensor[] tensors, int num_extras, int num_named, str names, "
      "str fp8=\"\", bool replay_rng=False, str autocast=\"\", int call_id=0) -> Tensor[]");
  // Its backward by recomputation: a gradient for each of the call's tensors.
  m.def(
      "sequential_call_backward(int handle, Tensor[] tensors, int num_extras, int num_named, "
      "str names, Tensor[] grad_outputs, str fp8=\"\", Tensor? fp8_scales=None, "
      "Tensor? rng_state=None, str autocast=\"\", int call_id=0) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("sequential_call", &fusible::fuser::sequential_call);
  m.impl("sequential_call_backward", &fusible::fuser::sequential_call_backward);
}

// In C++ too, so a compiled graph's call (which passes the Autograd key) runs no Python.
TORCH_LIBRARY_IMPL(fusible, Autograd, m) {
  m.impl("sequential_call", &fusible::fuser::sequential_call_autograd);
  m.impl("sequential_call_backward", torch::autograd::autogradNotImplementedFallback());
}

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("sequential_call", &fusible::fuser::sequential_call);
  m.impl("sequential_call_backward", &fusible::fuser::sequential_call_backward);
}

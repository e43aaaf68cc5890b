// OperationFuser: flattening, each call's parameters, planning, and the one autograd node per call.
#include "fuser/operation_fuser.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <string>
#include <unordered_set>

#include "common/checks.h"
#include "fuser/fuser_call.h"
#include "ops/fp8_state_rollback.h"
#include "ops/quantization.h"

namespace fusible::fuser {

using ops::BasicOperation;
using ops::FusibleOperation;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

std::shared_ptr<const ParamLayout> make_param_layout(
    const std::vector<std::shared_ptr<BasicOperation>>& basic_ops) {
  auto layout = std::make_shared<ParamLayout>();
  for (const auto& op : basic_ops) {
    std::vector<int64_t> pos;
    for (size_t k = op->op_parameters().size(); k-- > 0;) pos.push_back(layout->size++);
    layout->pos.push_back(std::move(pos));
  }
  return layout;
}

}  // namespace

OperationFuser::OperationFuser(std::vector<std::shared_ptr<FusibleOperation>> ops,
                               FuserOptions options)
    : ops_(std::move(ops)), options_(std::move(options)) {
  for (const auto& op : ops_) {
    TORCH_CHECK_VALUE(op != nullptr, "OperationFuser: expected operations, got a null op");
    for (auto& b : op->basic_ops()) basic_ops_.push_back(b);
  }
  routing_ = build_routing(basic_ops_, options_.external_inputs, options_.export_channels);
  routing_version_ = routing_version_sum();
  param_layout_ = make_param_layout(basic_ops_);
  // Last: a constructor that throws runs no destructor, so it must not have locked anything.
  if (options_.lock_channels) {
    for (auto& op : basic_ops_) op->lock_channels();
  }
}

OperationFuser::~OperationFuser() {
  if (options_.lock_channels) {
    for (auto& op : basic_ops_) op->unlock_channels();
  }
}

int64_t OperationFuser::num_extra_outputs() const {
  int64_t n = 0;
  for (const auto& e : routing_->exported) n += e.is_public;
  return n;
}

int64_t OperationFuser::routing_version_sum() const {
  int64_t v = 0;
  for (const auto& op : basic_ops_) v += op->routing_version();
  return v;
}

void OperationFuser::reroute_if_changed() {
  // Only a throw-away fuser can see its ops' routing change (persistent ones lock it).
  if (options_.lock_channels) return;
  const auto v = routing_version_sum();
  if (v == routing_version_) return;
  routing_ = build_routing(basic_ops_, options_.external_inputs, options_.export_channels);
  routing_version_ = v;
  plan_.reset();  // a plan's fused ops may depend on the routing
}

std::vector<at::Tensor> OperationFuser::registered_parameters() {
  std::vector<at::Tensor> params;
  params.reserve(param_layout_->size);
  bool layout_matches = true;
  for (size_t i = 0; i < basic_ops_.size(); ++i) {
    auto own = basic_ops_[i]->op_parameters();
    layout_matches = layout_matches && own.size() == param_layout_->pos[i].size();
    for (auto& p : own) params.push_back(std::move(p));
  }
  // An op written in Python may register a parameter after the fuser was made.
  if (!layout_matches) param_layout_ = make_param_layout(basic_ops_);
  return params;
}

void OperationFuser::prepare_parameters(const at::Tensor& input, at::TensorList params,
                                        bool from_caller) {
  bool any_meta = false;
  for (const auto& p : params) any_meta = any_meta || p.is_meta();
  // Meta in, meta out: a meta input computes shapes and materializes nothing. Without meta
  // parameters nothing is adopted either: a call's tensors (functional_call's, say) never replace
  // the module's own.
  if (!any_meta || input.is_meta()) return;
  // Materialization and reset act on the ops' registered parameters: make those the caller's,
  // and put them back if materializing fails (the module is left as it was).
  std::vector<std::vector<at::Tensor>> previous;
  if (from_caller) {
    for (size_t i = 0; i < basic_ops_.size(); ++i) {
      previous.push_back(basic_ops_[i]->op_parameters());
      std::vector<at::Tensor> own;
      for (auto pos : param_layout_->pos[i]) own.push_back(params[pos]);
      basic_ops_[i]->adopt_parameters(own);
    }
  }
  try {
    // On the top-level ops in order (a composite can act), before the parameters decide
    // anything: meta parameters become real on the input's device here, in place.
    for (const auto& op : ops_) op->pre_first_forward(input);
  } catch (...) {
    for (size_t i = 0; i < previous.size(); ++i) basic_ops_[i]->adopt_parameters(previous[i]);
    throw;
  }
}

int64_t OperationFuser::first_backward_index(const at::Tensor& input, at::TensorList params,
                                             const std::vector<at::Tensor>& extra_inputs,
                                             const std::vector<at::Tensor>& external) const {
  const auto n = static_cast<int64_t>(basic_ops_.size());
  if (!at::GradMode::is_enabled()) return n;
  if (input.requires_grad()) return 0;
  for (int64_t i = 0; i < n; ++i) {
    for (auto pos : param_layout_->pos[i]) {
      if (params[pos].requires_grad()) return i;
    }
    for (const auto& src : routing_->inputs[i]) {
      if (src.kind == InputSource::Kind::kPublic && extra_inputs[src.index].requires_grad())
        return i;
      if (src.kind == InputSource::Kind::kExternal && external[src.index].requires_grad()) return i;
    }
  }
  return n;
}

namespace {

enum class Direction { kAny, kForward, kBackward };

// Checks that a plan expands back to exactly the fuser's basic ops, in order; returns its entries.
// A fused op that does not implement `direction` is split into its basic ops.
std::vector<PlannedOp> expand_plan(const ops::OpList& planned,
                                   const std::vector<std::shared_ptr<BasicOperation>>& basic,
                                   const std::string& stage,
                                   Direction direction = Direction::kAny) {
  std::vector<PlannedOp> out;
  int64_t next = 0;
  for (const auto& op : planned) {
    TORCH_CHECK(op != nullptr, "OperationFuser: fusion ", stage, " returned a null op");
    PlannedOp p{op, {}};
    for (const auto& b : op->basic_ops()) {
      TORCH_CHECK(next < static_cast<int64_t>(basic.size()) && b.get() == basic[next].get(),
                  "OperationFuser: fusion ", stage, " returned ops that do not expand back to the ",
                  "basic ops in order (", op->type_name(), " at basic op ", next, ")");
      p.basic_indices.push_back(next++);
    }
    TORCH_CHECK(!p.basic_indices.empty(), "OperationFuser: fusion ", stage, " returned ",
                op->type_name(), ", which covers no basic op");
    const bool split = (direction == Direction::kForward && !op->fuses_forward()) ||
                       (direction == Direction::kBackward && !op->fuses_backward());
    if (split) {
      for (auto i : p.basic_indices) out.push_back({basic[i], {i}});
      continue;
    }
    out.push_back(std::move(p));
  }
  TORCH_CHECK(next == static_cast<int64_t>(basic.size()), "OperationFuser: fusion ", stage,
              " dropped basic ops (expanded to ", next, " of ", basic.size(), ")");
  return out;
}

ops::OpList run_fusions(ops::OpList list, ops::FusionPass pass, const ops::FusionContext& fctx,
                        const std::vector<std::shared_ptr<BasicOperation>>& basic) {
  for (const auto& e : ops::FusionRegistry::instance().entries(pass)) {
    list = e.fn(std::move(list), fctx);
    expand_plan(list, basic, "'" + e.name + "'");
  }
  return list;
}

}  // namespace

std::shared_ptr<const Plan> OperationFuser::plan_for(
    int64_t first_backward, const std::vector<at::ScalarType>& param_dtypes) {
  const std::lock_guard<std::mutex> lock(plan_mutex_);
  const auto version = ops::FusionRegistry::instance().version();
  // Fusion functions see the recipe kind (te.ops re-fuses when it changes).
  const auto& autocast = ops::fp8_autocast();
  const std::string recipe = autocast.enabled && autocast.recipe ? autocast.recipe->kind : "";
  std::vector<int64_t> settings;
  settings.reserve(basic_ops_.size());
  for (const auto& op : basic_ops_) settings.push_back(op->plan_settings());
  if (plan_ && plan_first_backward_ == first_backward && plan_registry_version_ == version &&
      plan_param_dtypes_ == param_dtypes && plan_recipe_ == recipe && plan_settings_ == settings) {
    return plan_;
  }
  ops::OpList list(basic_ops_.begin(), basic_ops_.end());
  ops::FusionContext fctx;
  fctx.first_backward = first_backward;
  fctx.recipe = recipe;
  for (size_t i = 0; i < basic_ops_.size(); ++i) {
    // An op at two positions (tied): its first, so runs_backward says whether every occurrence
    // runs its backward (a fusion of the later one must not assume the earlier one saved).
    fctx.basic_index.emplace(basic_ops_[i].get(), static_cast<int64_t>(i));
    auto& dtypes = fctx.param_dtypes[basic_ops_[i].get()];
    for (auto pos : param_layout_->pos[i]) dtypes.push_back(param_dtypes[pos]);
  }
  list = run_fusions(std::move(list), ops::FusionPass::kForwardBackward, fctx, basic_ops_);
  auto plan = std::make_shared<Plan>();
  plan->forward = expand_plan(run_fusions(list, ops::FusionPass::kForward, fctx, basic_ops_),
                              basic_ops_, "(forward)", Direction::kForward);
  plan->backward = expand_plan(run_fusions(list, ops::FusionPass::kBackward, fctx, basic_ops_),
                               basic_ops_, "(backward)", Direction::kBackward);
  plan_ = std::move(plan);
  plan_first_backward_ = first_backward;
  plan_registry_version_ = version;
  plan_recipe_ = recipe;
  plan_settings_ = std::move(settings);
  plan_param_dtypes_ = param_dtypes;
  return plan_;
}

std::pair<std::vector<std::string>, std::vector<std::string>> OperationFuser::fusion_plan() const {
  std::pair<std::vector<std::string>, std::vector<std::string>> names;
  const std::lock_guard<std::mutex> lock(plan_mutex_);
  if (!plan_) return names;
  for (const auto& p : plan_->forward) names.first.push_back(p.op->plan_label(false));
  for (const auto& p : plan_->backward) names.second.push_back(p.op->plan_label(true));
  return names;
}

namespace {

// As torch's in-place ops: a leaf that requires grad is not written while autograd records (the
// write would change what its gradient is taken of; torch raises, a reentrant checkpoint's
// recompute would add into it a second time). Under no_grad the write goes ahead, as torch's.
void check_not_a_leaf_requiring_grad(const ops::FusibleOperation& op, const at::Tensor& t) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && t.requires_grad() && t.is_leaf()), op.type_name(),
              ": a leaf Variable that requires grad is being used in an in-place operation (the "
              "extra input it adds into in place); pass a tensor that is not a leaf requiring "
              "grad, or build the op with in_place=False");
}

// Whether the caller's extra tensor `index` shares no storage with the call's other tensors (its
// input, other extra tensors, the parameters): an op before the in-place one may have saved any of
// those for its backward (y = x + f(x) called as seq(x, x): f's saved x would hold the sum). The
// add then runs out of place, with the same values.
bool read_only_elsewhere(int64_t index, const at::Tensor& input,
                         const std::vector<at::Tensor>& extra_inputs,
                         const std::vector<at::Tensor>& external, at::TensorList params) {
  const auto& extra = extra_inputs[index];
  if (!extra.defined() || !extra.has_storage()) return true;
  const auto shares = [&](const at::Tensor& t) {
    return t.defined() && t.has_storage() && extra.is_alias_of(t);
  };
  if (shares(input)) return false;
  for (size_t i = 0; i < extra_inputs.size(); ++i) {
    if (static_cast<int64_t>(i) != index && shares(extra_inputs[i])) return false;
  }
  return std::none_of(external.begin(), external.end(), shares) &&
         std::none_of(params.begin(), params.end(), shares);
}

}  // namespace

c10::intrusive_ptr<FuserCall> OperationFuser::make_call(const at::Tensor& input,
                                                        at::TensorList params,
                                                        const std::vector<at::Tensor>& extra_inputs,
                                                        const std::vector<at::Tensor>& external,
                                                        int64_t first_backward) {
  auto call = c10::make_intrusive<FuserCall>();
  call->param_dtypes.reserve(params.size());
  for (const auto& p : params) call->param_dtypes.push_back(p.scalar_type());
  call->plan = plan_for(first_backward, call->param_dtypes);
  call->first_backward = first_backward;
  call->input_requires_grad = at::GradMode::is_enabled() && input.requires_grad();
  call->routing = routing_;
  call->params = param_layout_;
  for (const auto& op : basic_ops_) {
    if (auto k = op->keep_alive()) call->keep_alive.push_back(std::move(k));
  }
  const auto n = static_cast<int64_t>(basic_ops_.size());
  call->ctxs.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    auto& ctx = *call->ctxs.emplace_back(std::make_shared<ops::OperationContext>());
    ctx.requires_grad = i >= first_backward;
    ctx.input_requires_grad = i > first_backward || (i == 0 && call->input_requires_grad);
    ctx.call_records_node = first_backward < n;
    for (auto pos : param_layout_->pos[i]) {
      ctx.params.push_back(params[pos]);
      ctx.param_requires_grad.push_back(ctx.requires_grad && params[pos].requires_grad());
    }
    for (const auto& src : routing_->inputs[i]) {
      // Inside the autograd forward tensors are detached: "needs gradient" is passed explicitly.
      bool needs = false;
      switch (src.kind) {
        case InputSource::Kind::kPublic:
          needs = extra_inputs[src.index].requires_grad();
          break;
        case InputSource::Kind::kExternal:
          needs = external[src.index].requires_grad();
          break;
        case InputSource::Kind::kInternal:
          needs = src.op >= first_backward;
          break;
      }
      ctx.extra_input_requires_grad.push_back(ctx.requires_grad && needs);
      const bool writable = src.kind == InputSource::Kind::kPublic &&
                            basic_ops_[i]->writes_extra_inputs() &&
                            read_only_elsewhere(src.index, input, extra_inputs, external, params);
      if (writable) check_not_a_leaf_requiring_grad(*basic_ops_[i], extra_inputs[src.index]);
      ctx.extra_input_writable.push_back(writable);
    }
  }
  return call;
}

namespace {

// A caller's tensor that an op wrote in place (returned as an output) gets a new version, so a node
// that saved it earlier fails loudly instead of using the sum (our kernels and cuBLASLt write
// through raw pointers, which bumps nothing).
void bump_written_inputs(const std::vector<at::Tensor>& outputs,
                         const std::vector<at::Tensor>& extras,
                         const std::vector<at::Tensor>& external) {
  for (const auto& out : outputs) {
    for (const auto* inputs : {&extras, &external}) {
      for (const auto& e : *inputs) {
        if (out.defined() && e.unsafeGetTensorImpl() == out.unsafeGetTensorImpl()) {
          torch::autograd::impl::bump_version(e);
        }
      }
    }
  }
}

// "[LayerNorm, BasicLinear, ...]": the ops of a plan, for error messages.
std::string op_names(const Plan& plan) {
  std::string out = "[";
  for (const auto& p : plan.forward) out += (out.size() > 1 ? ", " : "") + p.op->type_name();
  return out + "]";
}

// Moves every context's to_save into its saved_tensors, routing each tensor the caller can reach
// (sharing storage with an input, parameter, extra tensor or output) through autograd's
// save_for_backward, where its version is checked; the rest stays in the context, for the backward
// to free op by op. With saved-tensor hooks active (activation checkpointing, CPU offload) every
// tensor goes through autograd, so the hooks see them all.
void save_tensors(AutogradContext& actx, FuserCall& call,
                  std::initializer_list<at::TensorList> visible) {
  // A handful of storages: a linear scan beats a hash set built per call.
  std::vector<const c10::StorageImpl*> reachable;
  for (const auto& group : visible) {
    for (const auto& t : group) {
      if (t.defined() && t.has_storage()) reachable.push_back(t.storage().unsafeGetStorageImpl());
    }
  }
  const auto is_reachable = [&](const at::Tensor& t) {
    return std::find(reachable.begin(), reachable.end(), t.storage().unsafeGetStorageImpl()) !=
           reachable.end();
  };
  const bool hooks = at::SavedTensorDefaultHooks::get_hooks().has_value();
  std::vector<at::Tensor> through_autograd;
  call.saved_slots.assign(call.ctxs.size(), {});
  for (size_t i = 0; i < call.ctxs.size(); ++i) {
    auto& c = *call.ctxs[i];
    auto& slots = call.saved_slots[i];
    c.saved_tensors.assign(c.to_save.size(), at::Tensor());
    for (size_t j = 0; j < c.to_save.size(); ++j) {
      auto& t = c.to_save[j];
      const bool internal =
          !hooks && !c.check_saved_versions && t.defined() && t.has_storage() && !is_reachable(t);
      if (internal) {
        slots.push_back(-1);
        c.saved_tensors[j] = std::move(t);
      } else {
        slots.push_back(static_cast<int64_t>(through_autograd.size()));
        through_autograd.push_back(std::move(t));
      }
    }
    c.to_save.clear();
    c.saved_for_backward = true;
  }
  actx.save_for_backward(through_autograd);
}

}  // namespace

// The one autograd node per fuser call.
struct FuserAutograd : public torch::autograd::Function<FuserAutograd> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input, at::TensorList params,
                               at::TensorList extra_inputs, at::TensorList external_inputs,
                               const c10::intrusive_ptr<FuserCall>& call) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    const std::vector<at::Tensor> extras(extra_inputs.begin(), extra_inputs.end());
    const std::vector<at::Tensor> external(external_inputs.begin(), external_inputs.end());
    call->grad_shapes.reserve(1 + params.size() + extra_inputs.size() + external_inputs.size());
    for (const auto list : {at::TensorList(input), params, extra_inputs, external_inputs}) {
      for (const auto& t : list) call->grad_shapes.emplace_back(t.sizes());
    }
    std::vector<at::Tensor> outputs;
    {
      // apply() turns grad mode off but leaves the autograd keys on: without this, every op would
      // pass through its (boxed) autograd kernel.
      const at::AutoDispatchBelowAutograd below_autograd;
      outputs = run_forward(*call, input, extras, external);
    }
    save_tensors(*ctx, *call, {input, params, extra_inputs, external_inputs, outputs});

    // An output that repeats an earlier output needs its own tensor, or both would share one
    // gradient slot; an output that is a caller's extra input was written in place, and is
    // marked so (never a leaf that requires grad: make_call refused one).
    bump_written_inputs(outputs, extras, external);
    std::unordered_set<const c10::TensorImpl*> seen;
    std::vector<at::Tensor> dirty;
    const auto written = [&](const at::Tensor& e, const c10::TensorImpl* impl) {
      return e.unsafeGetTensorImpl() == impl;
    };
    for (auto& out : outputs) {
      const auto* impl = out.unsafeGetTensorImpl();
      for (const auto& e : extras) {
        if (written(e, impl)) dirty.push_back(out);
      }
      for (const auto& e : external) {
        if (written(e, impl)) dirty.push_back(out);
      }
      if (!seen.insert(impl).second) out = out.alias();
    }
    if (!dirty.empty()) ctx->mark_dirty(dirty);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto call = c10::static_intrusive_pointer_cast<FuserCall>(ctx->saved_data["call"].toCapsule());
    // Our backwards are not differentiable: fail loudly instead of returning wrong second
    // derivatives.
    TORCH_CHECK(!at::GradMode::is_enabled(), "OperationFuser ", op_names(*call->plan),
                ": double backward (backward with create_graph=True) through a fuser call is not ",
                "supported");
    // The call-internal tensors live in the contexts: a backward that did not keep the graph (or
    // failed part-way through one) freed them, and autograd cannot tell when it saved none itself.
    for (size_t i = 0; i < call->ctxs.size(); ++i) {
      TORCH_CHECK(call->ctxs[i]->saved_tensors.size() == call->saved_slots[i].size(),
                  "OperationFuser ", op_names(*call->plan),
                  ": trying to backward through the graph a second time, after its saved tensors "
                  "were freed; specify retain_graph=True the first time");
    }
    const auto saved = ctx->get_saved_variables();
    // A kept graph (retain_graph=True) runs this backward again: its tensors must stay.
    const bool keep = torch::autograd::get_current_graph_task_keep_graph();
    for (size_t i = 0; i < call->ctxs.size(); ++i) {
      const auto& slots = call->saved_slots[i];
      for (size_t j = 0; j < slots.size(); ++j) {
        if (slots[j] >= 0) call->ctxs[i]->saved_tensors[j] = saved[slots[j]];
      }
      call->ctxs[i]->release_saved = !keep;
    }
    // Below autograd, as the forward runs: our ops record nothing here anyway (double backward is
    // refused above), and their autograd kernel is a boxed fallback whose cost shows in small
    // calls.
    const at::AutoDispatchBelowAutograd below_autograd;
    auto grads = run_backward(*call, grad_outputs);  // without keep, it freed what it ran
    for (size_t i = 0; keep && i < call->ctxs.size(); ++i) {
      auto& kept = call->ctxs[i]->saved_tensors;
      const auto& slots = call->saved_slots[i];
      for (size_t j = 0; j < kept.size(); ++j) {
        if (slots[j] >= 0) kept[j] = at::Tensor();  // autograd holds these
      }
    }
    grads.emplace_back();  // for the call argument
    return grads;
  }
};

std::vector<std::string> OperationFuser::extra_input_takers() const {
  std::vector<std::string> out(routing_->num_public_inputs);
  for (size_t op = 0; op < routing_->inputs.size(); ++op) {
    for (size_t slot = 0; slot < routing_->inputs[op].size(); ++slot) {
      const auto& src = routing_->inputs[op][slot];
      if (src.kind == InputSource::Kind::kPublic) {
        out.at(src.index) =
            basic_ops_[op]->type_name() + " (extra input " + std::to_string(slot) + ")";
      }
    }
  }
  return out;
}

std::string extra_input_error(const char* who, const std::vector<std::string>& takers, size_t got) {
  std::string out = std::string(who) + ": expected " + std::to_string(takers.size()) +
                    " extra inputs, got " + std::to_string(got);
  if (!takers.empty()) out += "; in order they feed " + c10::Join(", ", takers);
  if (got < takers.size()) {
    out +=
        " (pass them after the input, or bind an op's extra input to a channel with "
        "set_extra_input_channel and feed it by name)";
  }
  return out;
}

std::vector<at::Tensor> OperationFuser::forward(
    const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
    const std::vector<std::pair<std::string, at::Tensor>>& named_inputs,
    std::optional<at::TensorList> caller_params) {
  // A call that raises part way puts back the delayed-scaling updates of the casts that ran.
  ops::Fp8StateRollback rollback(basic_ops_);
  auto outputs = forward_covered(input, extra_inputs, named_inputs, caller_params);
  rollback.commit();
  return outputs;
}

std::vector<at::Tensor> OperationFuser::forward_covered(
    const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
    const std::vector<std::pair<std::string, at::Tensor>>& named_inputs,
    std::optional<at::TensorList> caller_params) {
  reroute_if_changed();
  TORCH_CHECK_VALUE(input.defined(), "OperationFuser: expected an input tensor, got None");
  TORCH_CHECK_TYPE(input.is_floating_point(),
                   basic_ops_.empty() ? std::string("OperationFuser") : basic_ops_[0]->type_name(),
                   ": expected a floating-point input, got ", input.scalar_type());
  TORCH_CHECK_VALUE(static_cast<int64_t>(extra_inputs.size()) == routing_->num_public_inputs,
                    extra_input_error("OperationFuser", extra_input_takers(), extra_inputs.size()));
  for (size_t i = 0; i < extra_inputs.size(); ++i) {
    TORCH_CHECK_VALUE(extra_inputs[i].defined(), "OperationFuser: extra input ", i, " is None");
  }
  std::vector<at::Tensor> external;
  external.reserve(routing_->external_inputs.size());
  for (const auto& name : routing_->external_inputs) {
    const at::Tensor* found = nullptr;
    for (const auto& [n, t] : named_inputs) {
      if (n == name) found = &t;
    }
    TORCH_CHECK_VALUE(found != nullptr && found->defined(), "OperationFuser: channel '", name,
                      "' has no producer and no named input was supplied for it");
    external.push_back(*found);
  }
  // A view of the caller's tensors (no copy on the per-call path), or of the registered ones.
  std::vector<at::Tensor> registered;
  at::TensorList params;
  if (caller_params) {
    params = *caller_params;
    TORCH_CHECK_VALUE(static_cast<int64_t>(params.size()) == param_layout_->size,
                      "OperationFuser: expected ", param_layout_->size, " parameters, got ",
                      params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(params[i].defined(), "OperationFuser: parameter ", i, " is None");
    }
  } else {
    registered = registered_parameters();
    params = registered;
  }
  prepare_parameters(input, params, caller_params.has_value());
  const auto first_backward = first_backward_index(input, params, extra_inputs, external);
  auto call = make_call(input, params, extra_inputs, external, first_backward);
  if (first_backward == static_cast<int64_t>(basic_ops_.size())) {
    // Nothing needs a gradient: no node, nothing saved, and the ops run below autograd (their
    // autograd kernel, a boxed fallback, would only cost host time).
    const at::NoGradGuard no_grad;
    const at::AutoDispatchBelowAutograd below_autograd;
    auto outputs = run_forward(*call, input, extra_inputs, external);
    bump_written_inputs(outputs, extra_inputs, external);
    return outputs;
  }
  return FuserAutograd::apply(input, params, at::TensorList(extra_inputs), at::TensorList(external),
                              call);
}

}  // namespace fusible::fuser

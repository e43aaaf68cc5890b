// The forward and backward walks over a plan, shared by the autograd path and the no-grad path,
// including channel routing between ops.
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuser/fuser_call.h"

namespace fusible::fuser {
namespace {

// Whether this forward's FP8 casts take amaxes from their producers (OperationContext's handoff):
// per-tensor current scaling.
bool per_tensor_current_scaling() {
  const auto& autocast = ops::fp8_autocast();
  return autocast.enabled && autocast.recipe && autocast.recipe->kind == "current" &&
         ops::fp8_amax_handoff();
}

// Whether an activation before a linear hands over act(pre) (OperationContext::want_output_act):
// under delayed scaling, whose one-pass cast applies the activation on the way in. Current scaling
// would compute it twice (the amax pass, then the cast), and the block-scaled tile kernel slows
// down by more than the activation kernel it saves (measured on the H200: bench/RESULTS.md).
bool defers_activations() {
  const auto& autocast = ops::fp8_autocast();
  return autocast.enabled && autocast.recipe && autocast.recipe->kind == "delayed";
}

std::vector<ops::OperationContext*> contexts_of(FuserCall& call, const PlannedOp& p) {
  std::vector<ops::OperationContext*> out;
  out.reserve(p.basic_indices.size());
  for (auto i : p.basic_indices) out.push_back(call.ctxs[i].get());
  return out;
}

bool inside(const PlannedOp& p, int64_t op) {
  return op >= p.basic_indices.front() && op <= p.basic_indices.back();
}

void accumulate(at::Tensor& slot, const at::Tensor& g) {
  if (!g.defined()) return;
  slot = slot.defined() ? slot + g : g;
}

// A gradient must have its tensor's shape: autograd would sum a broadcastable one away silently.
void check_grad_shape(const FuserCall& call, const ops::FusibleOperation& op, const at::Tensor& g,
                      size_t slot, const char* what) {
  if (!g.defined() || slot >= call.grad_shapes.size()) return;
  const auto& shape = call.grad_shapes[slot];
  TORCH_CHECK(g.sizes().equals(shape), op.type_name(), ": backward returned a gradient of shape ",
              g.sizes(), " for ", what, " of shape ", c10::IntArrayRef(shape));
}

}  // namespace

std::vector<at::Tensor> run_forward(FuserCall& call, const at::Tensor& input,
                                    const std::vector<at::Tensor>& extra_inputs,
                                    const std::vector<at::Tensor>& external) {
  const auto args = ops::forward_args_for(input);
  const auto& routing = *call.routing;
  const size_t n = call.ctxs.size();
  ops::TensorLists produced(n);
  for (size_t i = 0; i < n; ++i) produced[i].resize(routing.outputs[i].size());

  at::Tensor x = input;
  const auto& plan = call.plan->forward;
  const bool amax_handoff = per_tensor_current_scaling();
  const bool act_handoff = defers_activations();
  for (size_t k = 0; k < plan.size(); ++k) {
    const auto& p = plan[k];
    auto ctxs = contexts_of(call, p);
    // The next op casts this output with its amax: the producing kernel computes it.
    const bool next_takes_amax =
        amax_handoff && k + 1 < plan.size() && plan[k + 1].op->takes_input_amax();
    ctxs.back()->want_output_amax = next_takes_amax;
    // The next op casts this output to FP8: an activation hands over act(pre) instead.
    const bool next_takes_act =
        act_handoff && k + 1 < plan.size() && plan[k + 1].op->takes_input_act();
    ctxs.back()->want_output_act = next_takes_act;
    // Defaults for every covered op (a fused forward may not know its inner ops' inputs); the
    // first op's are exact.
    for (auto* c : ctxs) c->input_dtype = x.scalar_type();
    ctxs[0]->input_shape = x.sizes().vec();
    call.step_starts.resize(n);
    call.step_starts[p.basic_indices.front()] = 1;
    ops::TensorLists sub_in, sub_out;
    for (auto i : p.basic_indices) {
      std::vector<at::Tensor> in;
      for (const auto& src : routing.inputs[i]) {
        switch (src.kind) {
          case InputSource::Kind::kPublic:
            in.push_back(extra_inputs[src.index]);
            break;
          case InputSource::Kind::kExternal:
            in.push_back(external[src.index]);
            break;
          case InputSource::Kind::kInternal:
            // A producer inside this fused op wires the tensor itself.
            in.push_back(inside(p, src.op) ? at::Tensor() : produced[src.op][src.slot]);
            break;
        }
      }
      sub_in.push_back(std::move(in));
      sub_out.emplace_back(routing.outputs[i].size());
    }
    x = p.op->fuser_forward(ctxs, x, sub_in, sub_out, args);
    TORCH_CHECK(x.defined(), p.op->type_name(), ": forward returned no output tensor");
    ctxs.front()->input_amax = {};  // used (or not) by now
    if (next_takes_amax) {
      call.ctxs[plan[k + 1].basic_indices.front()]->input_amax =
          std::move(ctxs.back()->output_amax);
    }
    ctxs.back()->output_amax = {};
    ctxs.front()->input_act = {};  // resolved by now
    if (next_takes_act) {
      call.ctxs[plan[k + 1].basic_indices.front()]->input_act = std::move(ctxs.back()->output_act);
    }
    ctxs.back()->output_act = {};
    TORCH_CHECK(sub_out.size() == p.basic_indices.size(), p.op->type_name(),
                ": expected extra outputs for ", p.basic_indices.size(), " basic ops, got ",
                sub_out.size());
    for (size_t k = 0; k < p.basic_indices.size(); ++k) {
      const auto i = p.basic_indices[k];
      const auto& sinks = routing.outputs[i];
      TORCH_CHECK(sub_out[k].size() == sinks.size(), p.op->type_name(), ": expected ", sinks.size(),
                  " extra outputs for basic op ", i, " (a fixed-size list per op), got ",
                  sub_out[k].size());
      for (size_t s = 0; s < sinks.size(); ++s) {
        if (sub_out[k][s].defined()) {
          produced[i][s] = std::move(sub_out[k][s]);
          continue;
        }
        TORCH_CHECK(!sinks[s].is_public, p.op->type_name(),
                    ": returned no tensor for extra output ", s, " of basic op ", i,
                    ", which is public");
        bool outside = sinks[s].position >= 0;
        for (const auto& [c_op, c_slot] : sinks[s].consumers) outside = outside || !inside(p, c_op);
        TORCH_CHECK(!outside, p.op->type_name(), ": returned no tensor for extra output ", s,
                    " of basic op ", i, " (channel '", sinks[s].name,
                    "'), which an op outside its forward fusion consumes");
      }
    }
  }
  std::vector<at::Tensor> outputs(1 + routing.exported.size());
  outputs[0] = x;
  for (size_t i = 0; i < n; ++i) {
    for (size_t s = 0; s < routing.outputs[i].size(); ++s) {
      const auto pos = routing.outputs[i][s].position;
      if (pos >= 0) outputs[pos + 1] = produced[i][s];
    }
  }
  for (auto& c : call.ctxs) c->params.clear();  // the backward needs only what was saved
  call.output_shape = x.sizes().vec();
  call.output_options = x.options();
  return outputs;
}

namespace {

// p's backward; reading a saved tensor that the forward (another op, when fused) did not save is
// an error naming both and what was saved, not a bare out_of_range.
ops::BackwardResult backward_of(const FuserCall& call, const PlannedOp& p,
                                const std::vector<ops::OperationContext*>& ctxs,
                                const at::Tensor& dy, const ops::TensorLists& grad_extra_out) {
  std::vector<size_t> saved;
  for (const auto* c : ctxs) saved.push_back(c->saved_tensors.size());
  try {
    return p.op->fuser_backward(ctxs, dy, grad_extra_out);
  } catch (const std::out_of_range&) {
    std::vector<std::string> forwards;
    for (const auto& f : call.plan->forward) {
      const bool overlaps =
          std::any_of(f.basic_indices.begin(), f.basic_indices.end(), [&](auto i) {
            return std::find(p.basic_indices.begin(), p.basic_indices.end(), i) !=
                   p.basic_indices.end();
          });
      if (overlaps) forwards.push_back(f.op->type_name());
    }
    TORCH_CHECK(false, p.op->type_name(),
                ": its backward read a saved tensor that the forward did not save (forward ran as ",
                c10::Join(", ", forwards), "; tensors saved per basic op: ", c10::Join(", ", saved),
                "). A fused forward must save in each basic op's context what that op's backward "
                "reads, or come with its own backward fusion");
  }
}

}  // namespace

std::vector<at::Tensor> run_backward(FuserCall& call, const std::vector<at::Tensor>& grad_outputs) {
  const auto& routing = *call.routing;
  const size_t n = call.ctxs.size();
  const auto num_params = call.params->size;
  // Gradient of every extra output: the caller's, plus each consumer's as its backward runs.
  ops::TensorLists grad_extra_out(n);
  for (size_t i = 0; i < n; ++i) {
    for (const auto& sink : routing.outputs[i]) {
      grad_extra_out[i].push_back(sink.position >= 0 ? grad_outputs.at(sink.position + 1)
                                                     : at::Tensor());
    }
  }
  at::Tensor dy = grad_outputs.at(0);
  if (!dy.defined()) dy = at::zeros(call.output_shape, call.output_options);

  std::vector<at::Tensor> grads(1 + num_params + routing.num_public_inputs +
                                routing.external_inputs.size());
  const auto& plan = call.plan->backward;
  const bool amax_handoff = ops::fp8_amax_handoff();
  for (size_t j = plan.size(); j-- > 0;) {
    const auto& p = plan[j];
    if (p.basic_indices.back() < call.first_backward) break;
    auto ctxs = contexts_of(call, p);
    ops::TensorLists sub_grad_out;
    for (auto i : p.basic_indices) sub_grad_out.push_back(grad_extra_out[i]);
    // The op before casts this op's input gradient with its amax: the producing kernel computes it.
    const int64_t consumer = p.basic_indices.front() - 1;
    const bool prev_takes_amax = amax_handoff && consumer >= call.first_backward &&
                                 call.ctxs[consumer]->takes_grad_output_amax;
    ctxs.front()->want_grad_input_amax = prev_takes_amax;
    auto r = backward_of(call, p, ctxs, dy, sub_grad_out);
    ctxs.back()->grad_output_amax = {};  // used (or not) by now
    if (prev_takes_amax) {
      call.ctxs[consumer]->grad_output_amax = std::move(ctxs.front()->grad_input_amax);
    }
    ctxs.front()->grad_input_amax = {};
    for (auto* c : ctxs) {
      if (c->release_saved) c->saved_tensors.clear();  // activations freed as eager frees them
    }
    const auto m = p.basic_indices.size();
    TORCH_CHECK(r.grad_params.size() == m && r.grad_extra_inputs.size() == m, p.op->type_name(),
                ": backward must return parameter and extra-input gradients for each of its ", m,
                " basic ops, got ", r.grad_params.size(), " and ", r.grad_extra_inputs.size());
    std::vector<std::shared_ptr<ops::BasicOperation>> fused_basics;  // made once, if needed
    for (size_t k = 0; k < m; ++k) {
      const auto i = p.basic_indices[k];
      const auto& pp = call.params->pos[i];
      TORCH_CHECK(r.grad_params[k].empty() || r.grad_params[k].size() == pp.size(),
                  p.op->type_name(), ": expected ", pp.size(), " parameter gradients for basic op ",
                  i, ", got ", r.grad_params[k].size());
      for (size_t s = 0; s < r.grad_params[k].size(); ++s) {
        const auto& g = r.grad_params[k][s];
        if (!g.defined()) continue;
        // The basic op owning the parameter sums it over a sequence-parallel group where it has
        // one, and may send it elsewhere (main_grad).
        if (p.op->is_fused() && fused_basics.empty()) fused_basics = p.op->basic_ops();
        auto& owner =
            p.op->is_fused() ? *fused_basics.at(k) : static_cast<ops::BasicOperation&>(*p.op);
        check_grad_shape(call, *p.op, g, 1 + pp[s], "a parameter");
        auto taken = owner.take_param_grad(
            s, ctxs.at(k)->param_grads_reduced ? g : owner.reduce_param_grad(g));
        if (taken.defined()) grads[1 + pp[s]] = ops::cast_to(taken, call.param_dtypes[pp[s]]);
      }
      const auto& sources = routing.inputs[i];
      TORCH_CHECK(r.grad_extra_inputs[k].empty() || r.grad_extra_inputs[k].size() == sources.size(),
                  p.op->type_name(), ": expected ", sources.size(),
                  " extra-input gradients for basic op ", i, ", got ",
                  r.grad_extra_inputs[k].size());
      for (size_t s = 0; s < r.grad_extra_inputs[k].size(); ++s) {
        const auto& g = r.grad_extra_inputs[k][s];
        const auto& src = sources[s];
        switch (src.kind) {
          case InputSource::Kind::kPublic:
            check_grad_shape(call, *p.op, g, 1 + num_params + src.index, "an extra input");
            accumulate(grads[1 + num_params + src.index], g);
            break;
          case InputSource::Kind::kExternal: {
            const auto slot = 1 + num_params + routing.num_public_inputs + src.index;
            check_grad_shape(call, *p.op, g, slot, "a channel input");
            accumulate(grads[slot], g);
            break;
          }
          case InputSource::Kind::kInternal:
            // Summed into the producer's output gradient before the producer's backward runs.
            if (!inside(p, src.op)) accumulate(grad_extra_out[src.op][src.slot], g);
            break;
        }
      }
    }
    dy = r.grad_input;
    const auto first = static_cast<size_t>(p.basic_indices.front());
    if (dy.defined() && first < call.step_starts.size() && call.step_starts[first]) {
      const auto& shape = ctxs[0]->input_shape;
      TORCH_CHECK(dy.sizes().equals(shape), p.op->type_name(),
                  ": backward returned an input gradient of shape ", dy.sizes(),
                  ", expected the input's shape ", c10::IntArrayRef(shape));
    }
    if (dy.defined()) dy = ops::cast_to(dy, ctxs[0]->input_dtype);
    TORCH_CHECK(dy.defined() || p.basic_indices.front() <= call.first_backward, p.op->type_name(),
                ": backward returned no input gradient, but earlier ops need one");
  }
  if (call.input_requires_grad) grads[0] = dy;
  return grads;
}

}  // namespace fusible::fuser

// The forward and backward walks over a plan, shared by the autograd path and the no-grad path.
#include <c10/util/Exception.h>

#include <ATen/autocast_mode.h>
#include <ATen/ops/zeros.h>

#include "fuser/fuser_call.h"

namespace fusible::fuser {
namespace {

ops::ForwardArgs forward_args(const at::Tensor& input) {
  ops::ForwardArgs args;
  const auto dev = input.device().type();
  if (at::autocast::is_autocast_enabled(dev)) {
    args.autocast_dtype = at::autocast::get_autocast_dtype(dev);
  }
  return args;
}

std::vector<ops::OperationContext*> contexts_of(FuserCall& call, const PlannedOp& p) {
  std::vector<ops::OperationContext*> out;
  out.reserve(p.basic_indices.size());
  for (auto i : p.basic_indices) out.push_back(&call.ctxs[i]);
  return out;
}

}  // namespace

std::vector<at::Tensor> run_forward(FuserCall& call, const at::Tensor& input,
                                    const std::vector<at::Tensor>& extra_inputs) {
  const auto args = forward_args(input);
  const size_t n = call.ctxs.size();
  ops::TensorLists extra_in(n), extra_out(n);
  for (size_t i = 0; i < n; ++i) {
    for (auto pos : call.extra_input_pos[i]) extra_in[i].push_back(extra_inputs[pos]);
    extra_out[i].resize(call.extra_output_pos[i].size());
  }
  at::Tensor x = input;
  for (const auto& p : call.plan->forward) {
    auto ctxs = contexts_of(call, p);
    // Defaults for every covered op (a fused forward may not know its inner ops' inputs); the
    // first op's are exact.
    for (auto* c : ctxs) c->input_dtype = x.scalar_type();
    ctxs[0]->input_shape = x.sizes().vec();
    ops::TensorLists sub_in, sub_out;
    for (auto i : p.basic_indices) {
      sub_in.push_back(extra_in[i]);
      sub_out.push_back(extra_out[i]);
    }
    x = p.op->fuser_forward(ctxs, x, sub_in, sub_out, args);
    TORCH_CHECK(x.defined(), p.op->type_name(), ": forward returned no output tensor");
    TORCH_CHECK(sub_out.size() == p.basic_indices.size(), p.op->type_name(),
                ": expected extra outputs for ", p.basic_indices.size(), " basic ops, got ",
                sub_out.size());
    for (size_t k = 0; k < p.basic_indices.size(); ++k) {
      const auto i = p.basic_indices[k];
      TORCH_CHECK(sub_out[k].size() == call.extra_output_pos[i].size(), p.op->type_name(),
                  ": expected ", call.extra_output_pos[i].size(), " extra outputs for basic op ", i,
                  ", got ", sub_out[k].size());
      for (size_t s = 0; s < sub_out[k].size(); ++s) {
        TORCH_CHECK(sub_out[k][s].defined(), p.op->type_name(), ": extra output ", s,
                    " of basic op ", i, " is public but the forward returned none");
      }
      extra_out[i] = std::move(sub_out[k]);
    }
  }
  std::vector<at::Tensor> outputs(1 + call.num_extra_outputs);
  outputs[0] = x;
  for (size_t i = 0; i < n; ++i) {
    for (size_t s = 0; s < extra_out[i].size(); ++s) {
      outputs[call.extra_output_pos[i][s] + 1] = extra_out[i][s];
    }
  }
  call.output_shape = x.sizes().vec();
  call.output_options = x.options();
  return outputs;
}

std::vector<at::Tensor> run_backward(FuserCall& call, const std::vector<at::Tensor>& grad_outputs) {
  const size_t n = call.ctxs.size();
  ops::TensorLists grad_extra_out(n);
  for (size_t i = 0; i < n; ++i) {
    for (auto pos : call.extra_output_pos[i]) grad_extra_out[i].push_back(grad_outputs.at(pos + 1));
  }
  at::Tensor dy = grad_outputs.at(0);
  if (!dy.defined()) dy = at::zeros(call.output_shape, call.output_options);

  std::vector<at::Tensor> grads(1 + call.num_params + call.num_extra_inputs);
  const auto& plan = call.plan->backward;
  for (size_t j = plan.size(); j-- > 0;) {
    const auto& p = plan[j];
    if (p.basic_indices.back() < call.first_backward) break;
    auto ctxs = contexts_of(call, p);
    ops::TensorLists sub_grad_out;
    for (auto i : p.basic_indices) sub_grad_out.push_back(grad_extra_out[i]);
    auto r = p.op->fuser_backward(ctxs, dy, sub_grad_out);
    const auto m = p.basic_indices.size();
    TORCH_CHECK(r.grad_params.size() == m && r.grad_extra_inputs.size() == m, p.op->type_name(),
                ": backward must return parameter and extra-input gradients for each of its ", m,
                " basic ops, got ", r.grad_params.size(), " and ", r.grad_extra_inputs.size());
    for (size_t k = 0; k < m; ++k) {
      const auto i = p.basic_indices[k];
      const auto& pp = call.param_pos[i];
      TORCH_CHECK(r.grad_params[k].empty() || r.grad_params[k].size() == pp.size(),
                  p.op->type_name(), ": expected ", pp.size(), " parameter gradients for basic op ",
                  i, ", got ", r.grad_params[k].size());
      for (size_t s = 0; s < r.grad_params[k].size(); ++s) {
        auto& g = r.grad_params[k][s];
        if (g.defined()) grads[1 + pp[s]] = ops::cast_to(g, call.param_dtypes[pp[s]]);
      }
      const auto& ep = call.extra_input_pos[i];
      TORCH_CHECK(r.grad_extra_inputs[k].empty() || r.grad_extra_inputs[k].size() == ep.size(),
                  p.op->type_name(), ": expected ", ep.size(),
                  " extra-input gradients for basic op ", i, ", got ",
                  r.grad_extra_inputs[k].size());
      for (size_t s = 0; s < r.grad_extra_inputs[k].size(); ++s) {
        const auto& g = r.grad_extra_inputs[k][s];
        if (!g.defined()) continue;
        auto& slot = grads[1 + call.num_params + ep[s]];
        slot = slot.defined() ? slot + g : g;
      }
    }
    dy = r.grad_input;
    if (dy.defined()) dy = ops::cast_to(dy, ctxs[0]->input_dtype);
    TORCH_CHECK(dy.defined() || p.basic_indices.front() <= call.first_backward, p.op->type_name(),
                ": backward returned no input gradient, but earlier ops need one");
  }
  if (call.input_requires_grad) grads[0] = dy;
  return grads;
}

}  // namespace fusible::fuser

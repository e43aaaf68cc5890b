// Default forward/backward plumbing of BasicOperation and FusedOperation.
#include "ops/fusible_operation.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "ops/parameter_utils.h"

namespace fusible::ops {

ForwardArgs forward_args_for(const at::Tensor& input) {
  ForwardArgs args;
  const auto dev = input.device().type();
  // Meta and other devices autocast does not know have no autocast state (meta in, meta out).
  if (at::autocast::is_autocast_available(dev) && at::autocast::is_autocast_enabled(dev)) {
    args.autocast_dtype = at::autocast::get_autocast_dtype(dev);
  }
  return args;
}

BasicOperation::BasicOperation(std::string type_name, int64_t num_extra_inputs,
                               int64_t num_extra_outputs)
    : FusibleOperation(type_name),
      type_name_(std::move(type_name)),
      num_extra_inputs_(num_extra_inputs),
      num_extra_outputs_(num_extra_outputs),
      input_channels_(num_extra_inputs),
      output_channels_(num_extra_outputs) {}

BasicOperation::BasicOperation(const BasicOperation& other)
    : FusibleOperation(other),
      type_name_(other.type_name_),
      num_extra_inputs_(other.num_extra_inputs_),
      num_extra_outputs_(other.num_extra_outputs_),
      input_channels_(other.input_channels_),
      output_channels_(other.output_channels_),
      fp8_recipe_(other.fp8_recipe_),
      param_grad_reduction_(other.param_grad_reduction_) {
  if (other.fp8_state_) {  // a copy owns its FP8 history, as its parameters
    auto state = std::make_shared<Fp8OpState>();
    for (auto [from, to] : {std::pair{&other.fp8_state_->forward, &state->forward},
                            std::pair{&other.fp8_state_->backward, &state->backward}}) {
      for (const auto& d : *from) to->push_back({d.amax_history.clone(), d.scale.clone()});
    }
    state->forward_format = other.fp8_state_->forward_format;
    state->backward_format = other.fp8_state_->backward_format;
    fp8_state_ = std::move(state);
  }
}

void BasicOperation::set_param_grad_reduction(std::optional<ProcessGroupSpec> group) {
  if (group) check_process_group(type_name_.c_str(), *group);
  // One process: nothing to sum.
  param_grad_reduction_ = group && group->size > 1 ? std::move(group) : std::nullopt;
}

std::string BasicOperation::plan_label(bool backward) const {
  return backward && param_grad_reduction_ ? type_name_ + "[all-reduce grad]" : type_name_;
}

at::Tensor BasicOperation::reduce_param_grad(const at::Tensor& grad) const {
  if (!param_grad_reduction_) return grad;
  return wait(all_reduce_start(type_name_.c_str(), grad, *param_grad_reduction_));
}

void BasicOperation::reset_fp8_state(std::shared_ptr<const Fp8Recipe> recipe, c10::Device device) {
  std::shared_ptr<Fp8OpState> state;
  if (recipe) {
    // Checks the recipe first (a bad one changes nothing); no amax reduction here.
    const Fp8AutocastGuard with(true, recipe, /*reduce_amaxes=*/false);
    current_fp8_cast(&state, num_quantizers(), device);  // fresh delayed-scaling state
  }
  fp8_state_ = std::move(state);
  fp8_recipe_ = std::move(recipe);
}

void BasicOperation::own_parameter_copies(const std::optional<c10::Device>& device) {
  const at::NoGradGuard no_grad;
  for (auto& item : parameters_) {
    auto& p = item.value();
    auto data = device && p.device() != *device ? p.to(*device) : p.clone();
    p = data.detach().requires_grad_(p.requires_grad());
  }
}

void BasicOperation::check_channel_index(const char* what, int64_t index, int64_t size) const {
  TORCH_CHECK_INDEX(index >= 0 && index < size, type_name_, ": ", what, " index ", index,
                    " is out of range (the op has ", size, " ", what, "s)");
}

BasicOperation& BasicOperation::set_extra_output_channel(int64_t index,
                                                         std::optional<std::string> channel,
                                                         bool output_to_caller) {
  check_channel_index("extra output", index, num_extra_outputs_);
  TORCH_CHECK_VALUE(!channel || !channel->empty(), type_name_,
                    ": channel must be None or a non-empty string, got ''");
  TORCH_CHECK(!channels_locked(), type_name_, ": a live Sequential or OperationFuser has already ",
              "captured its channel routing; drop or change that model first");
  const bool to_caller = channel ? output_to_caller : true;  // an unbound output is public
  output_channels_[index] = {std::move(channel), to_caller};
  ++routing_version_;
  return *this;
}

BasicOperation& BasicOperation::set_extra_input_channel(int64_t index,
                                                        std::optional<std::string> channel) {
  check_channel_index("extra input", index, num_extra_inputs_);
  TORCH_CHECK_VALUE(!channel || !channel->empty(), type_name_,
                    ": channel must be None or a non-empty string, got ''");
  TORCH_CHECK(!channels_locked(), type_name_, ": a live Sequential or OperationFuser has already ",
              "captured its channel routing; drop or change that model first");
  input_channels_[index] = std::move(channel);
  ++routing_version_;
  return *this;
}

std::vector<std::shared_ptr<BasicOperation>> BasicOperation::basic_ops() {
  return {std::static_pointer_cast<BasicOperation>(shared_from_this())};
}

void BasicOperation::pre_first_forward(const at::Tensor& input) {
  std::vector<at::Tensor> made;  // the parameters this call makes real
  for (const auto& p : op_parameters()) {
    if (p.is_meta()) made.push_back(p);
  }
  if (made.empty()) return;
  try {
    materialize_meta_parameters(input.device());  // an op's own layout (GroupedLinear's buffer)
    reset_parameters();
  } catch (...) {
    // Back to meta: left real, they would hold uninitialized memory that the next call computes
    // with; on meta, the next first call materializes and resets them again.
    for (const auto& p : made) materialize_(p, c10::Device(c10::kMeta));
    throw;
  }
}

bool BasicOperation::materialize_meta_parameters(c10::Device device) {
  bool any = false;
  for (const auto& p : op_parameters()) {
    if (p.is_meta()) {
      materialize_(p, device);
      any = true;
    }
  }
  return any;
}

void BasicOperation::adopt_parameters(const std::vector<at::Tensor>& params) {
  TORCH_CHECK(parameters_.size() == params.size(), type_name_, ": expected ", parameters_.size(),
              " parameters to adopt, got ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto& slot = parameters_[i].value();
    if (slot.unsafeGetTensorImpl() != params[i].unsafeGetTensorImpl()) slot = params[i];
  }
}

at::Tensor BasicOperation::op_forward(OperationContext&, const at::Tensor&, const ForwardArgs&) {
  TORCH_CHECK(false, type_name_, ": op_forward is not implemented (override op_forward, or ",
              "fuser_forward for an op with extra inputs or outputs)");
}

std::pair<at::Tensor, std::vector<at::Tensor>> BasicOperation::op_backward(OperationContext&,
                                                                           const at::Tensor&) {
  TORCH_CHECK(false, type_name_, ": op_backward is not implemented");
}

at::Tensor BasicOperation::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                         const at::Tensor& input, const TensorLists&, TensorLists&,
                                         const ForwardArgs& args) {
  TORCH_INTERNAL_ASSERT(ctxs.size() == 1, type_name_, ": expected one context");
  TORCH_CHECK(num_extra_inputs_ == 0 && num_extra_outputs_ == 0, type_name_,
              ": an op with extra inputs or outputs must override fuser_forward");
  return op_forward(*ctxs[0], input, args);
}

BackwardResult BasicOperation::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                              const at::Tensor& grad_output, const TensorLists&) {
  TORCH_INTERNAL_ASSERT(ctxs.size() == 1, type_name_, ": expected one context");
  auto [dx, dparams] = op_backward(*ctxs[0], grad_output);
  return {std::move(dx), {std::move(dparams)}, {{}}};
}

FusedOperation::FusedOperation(std::string type_name,
                               std::vector<std::shared_ptr<BasicOperation>> basic_ops)
    : FusibleOperation(type_name),
      basic_ops_(std::move(basic_ops)),
      type_name_(std::move(type_name)) {
  TORCH_CHECK(!basic_ops_.empty(), type_name_, ": expected at least one basic op");
}

at::Tensor FusedOperation::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                         const at::Tensor& input, const TensorLists& extra_inputs,
                                         TensorLists& extra_outputs, const ForwardArgs& args) {
  at::Tensor x = input;
  for (size_t i = 0; i < basic_ops_.size(); ++i) {
    ctxs[i]->input_dtype = x.scalar_type();
    ctxs[i]->input_shape = x.sizes().vec();
    TensorLists out(1, std::vector<at::Tensor>(basic_ops_[i]->num_extra_outputs()));
    x = basic_ops_[i]->fuser_forward({ctxs[i]}, x, {extra_inputs[i]}, out, args);
    extra_outputs[i] = std::move(out[0]);
  }
  return x;
}

BackwardResult FusedOperation::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                              const at::Tensor& grad_output,
                                              const TensorLists& grad_extra_outputs) {
  const size_t n = basic_ops_.size();
  BackwardResult result{at::Tensor(), TensorLists(n), TensorLists(n)};
  at::Tensor dy = grad_output;
  for (size_t i = n; i-- > 0;) {
    if (!ctxs[i]->requires_grad) break;  // earlier ops need no backward either
    auto r = basic_ops_[i]->fuser_backward({ctxs[i]}, dy, {grad_extra_outputs[i]});
    dy = r.grad_input.defined() ? cast_to(r.grad_input, ctxs[i]->input_dtype) : r.grad_input;
    result.grad_params[i] = std::move(r.grad_params[0]);
    result.grad_extra_inputs[i] = std::move(r.grad_extra_inputs[0]);
  }
  result.grad_input = dy;
  return result;
}

void FusedOperation::reset_parameters() {
  for (auto& op : basic_ops_) op->reset_parameters();
}

void FusedOperation::pre_first_forward(const at::Tensor& input) {
  for (auto& op : basic_ops_) op->pre_first_forward(input);
}

void FusedOperation::train(bool on) {
  torch::nn::Module::train(on);
  for (auto& op : basic_ops_) op->train(on);
}

}  // namespace fusible::ops

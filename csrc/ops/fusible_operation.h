// The operation hierarchy of te.ops in C++: FusibleOperation (what a fuser plans and runs),
// BasicOperation (one computation with its parameters) and FusedOperation (runs several basic ops).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/distributed.h"
#include "ops/operation_context.h"

namespace fusible::ops {

class BasicOperation;

/// Per-basic-op lists of tensors: extra inputs, extra outputs, parameter gradients.
using TensorLists = std::vector<std::vector<at::Tensor>>;

/// Call-wide settings the fuser hands every op.
struct ForwardArgs {
  /// torch.autocast's dtype when autocast is on for the input's device.
  std::optional<at::ScalarType> autocast_dtype;
};

/// What a fused backward returns for the basic ops it covers.
struct BackwardResult {
  at::Tensor grad_input;
  /// Per basic op, one gradient per parameter (in parameters() order); undefined = none.
  TensorLists grad_params;
  /// Per basic op, one gradient per extra input; undefined = zero.
  TensorLists grad_extra_inputs;
};

/// Anything the fuser can place in a plan.
class FusibleOperation : public torch::nn::Module {
 public:
  explicit FusibleOperation(std::string name) : torch::nn::Module(std::move(name)) {}

  /// Type name shown in fusion plans ("BasicLinear", "ForwardLinearBiasActivation").
  virtual std::string type_name() const = 0;
  /// The name fusion plans show for this op in the forward or backward plan: the type name, with
  /// where collectives run where the op runs any (tensor-parallel linears).
  virtual std::string plan_label(bool backward) const {
    (void)backward;
    return type_name();
  }
  virtual bool is_fused() const = 0;
  /// The basic ops this op stands for, in forward order (a basic op: itself).
  virtual std::vector<std::shared_ptr<BasicOperation>> basic_ops() = 0;

  /// Runs the forward of every covered basic op. ctxs, extra_inputs and extra_outputs have one
  /// entry per basic op; extra_outputs arrives sized and is filled here.
  virtual at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs,
                                   const at::Tensor& input, const TensorLists& extra_inputs,
                                   TensorLists& extra_outputs, const ForwardArgs& args) = 0;
  /// Runs the backward of every covered basic op (in reverse). grad_extra_outputs has one entry per
  /// basic op; an undefined gradient means zero.
  virtual BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                        const at::Tensor& grad_output,
                                        const TensorLists& grad_extra_outputs) = 0;

  /// Re-initializes parameters as the constructor would. Meta parameters are first materialized
  /// on default_parameter_device(). Ops with parameters override this.
  virtual void reset_parameters() {}

  /// torch::load into a deferred (meta) op: LibTorch gives each parameter the loaded tensor with
  /// set_data, which refuses a meta parameter; each meta parameter the archive holds becomes real
  /// in place on the loaded tensor's device first (same tensor object), then loads as any other.
  void load(torch::serialize::InputArchive& archive) override;

  /// Runs before a fuser call that finds meta parameters among this op's (the call's, adopted
  /// first), before the fuser looks at them: basic ops materialize meta parameters on the input's
  /// device and initialize them. A future op with first-use state (FP8 weights) hooks in here.
  virtual void pre_first_forward(const at::Tensor& input) = 0;

  /// Something a fuser call must hold until its backward has run (an op written in Python returns
  /// a reference to its Python object, which the caller may drop right after the forward).
  virtual std::shared_ptr<void> keep_alive() const { return nullptr; }

  /// Whether the forward casts its input per tensor under FP8 current scaling and takes the amax
  /// the op before it computed (OperationContext::input_amax): the fuser then asks that op for it.
  /// A fused op answers for its first basic op.
  virtual bool takes_input_amax() const { return false; }
  /// Whether the forward takes its input as a deferred activation (OperationContext::input_act):
  /// the op before it then hands over act(pre) without computing it, and this op either casts
  /// act(pre) to FP8 in one pass or computes it first. Only ops whose every read of the input goes
  /// through that resolution answer yes.
  virtual bool takes_input_act() const { return false; }
  /// Whether this op implements the forward / backward of its basic ops as one. A fused op that
  /// leaves a direction out is split into its basic ops in that direction's plan, so channels
  /// between them are still routed by the fuser.
  virtual bool fuses_forward() const { return true; }
  virtual bool fuses_backward() const { return true; }
};

/// One computation with its own parameters. Single-tensor ops implement op_forward / op_backward;
/// ops with extra inputs or outputs override fuser_forward / fuser_backward.
class BasicOperation : public FusibleOperation {
 public:
  BasicOperation(std::string type_name, int64_t num_extra_inputs = 0,
                 int64_t num_extra_outputs = 0);
  /// A copy with the same configuration and channels (held by no fuser yet), sharing the
  /// parameters until own_parameter_copies(); clone() is built on it.
  BasicOperation(const BasicOperation& other);
  BasicOperation& operator=(const BasicOperation&) = delete;
  /// Makes each registered parameter a copy of its own (on `device` when given).
  void own_parameter_copies(const std::optional<c10::Device>& device);

  std::string type_name() const override { return type_name_; }
  /// The type name; "<type>[all-reduce grad]" in the backward with a param_grad_reduction().
  std::string plan_label(bool backward) const override;
  bool is_fused() const override { return false; }
  std::vector<std::shared_ptr<BasicOperation>> basic_ops() override;
  int64_t num_extra_inputs() const { return num_extra_inputs_; }
  int64_t num_extra_outputs() const { return num_extra_outputs_; }
  /// Whether the forward may write into an extra input's storage (OperationContext's
  /// extra_input_writable says where it may): the fuser checks the caller's tensors only for
  /// such ops.
  virtual bool writes_extra_inputs() const { return false; }

  virtual at::Tensor op_forward(OperationContext& ctx, const at::Tensor& input,
                                const ForwardArgs& args);
  /// -> (grad_input, one gradient per parameter in parameters() order).
  virtual std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                                     const at::Tensor& grad_output);

  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

  /// This op's own parameters, in registration order (gradients follow this order). Virtual so
  /// ops defined in Python can report the parameters Python registered.
  virtual std::vector<at::Tensor> op_parameters() const { return parameters(/*recurse=*/false); }

  /// What autograd receives as the gradient of parameter `index` (op_parameters() order), given
  /// the one this op's backward computed (in the compute dtype; the fuser casts the result to the
  /// parameter's dtype): by default that gradient; an op may send it elsewhere and return what
  /// autograd gets instead (undefined: no gradient), as GroupedLinear's main_grad does.
  virtual at::Tensor take_param_grad(size_t index, const at::Tensor& grad) { return grad; }
  /// Sequence parallelism over a replicated parameter (the bias after a row-parallel linear's
  /// reduce-scatter, a norm over sequence-sharded rows): each rank's gradient covers its own rows
  /// only, so the fuser sums every parameter gradient of this op over `group` before
  /// take_param_grad, and every replica takes the same step. nullopt (the default): no reduction.
  void set_param_grad_reduction(std::optional<ProcessGroupSpec> group);
  const std::optional<ProcessGroupSpec>& param_grad_reduction() const {
    return param_grad_reduction_;
  }
  /// grad summed over param_grad_reduction()'s group (grad itself without one).
  at::Tensor reduce_param_grad(const at::Tensor& grad) const;

  void pre_first_forward(const at::Tensor& input) override;
  /// Materializes this op's meta parameters in place on `device`; returns whether any was meta.
  virtual bool materialize_meta_parameters(c10::Device device);
  /// Makes the registered parameters the given ones (a call's parameters, in op_parameters()
  /// order), so that reset_parameters() and materialization act on what the caller computes with.
  /// Ops whose parameters are not registered in C++ (written in Python) override it.
  virtual void adopt_parameters(const std::vector<at::Tensor>& params);

  /// A named extra output: `name` routes it to consumers; `to_caller` keeps it public too.
  struct OutputChannel {
    std::optional<std::string> name;
    bool to_caller = true;
  };
  /// Names extra-output slot `index` (nullopt unbinds: the output is public). Throws IndexError
  /// for a bad index, ValueError for an empty name, RuntimeError while a live fuser holds the
  /// routing.
  BasicOperation& set_extra_output_channel(int64_t index, std::optional<std::string> channel,
                                           bool output_to_caller = true);
  /// Makes extra-input slot `index` take the output named `channel` (nullopt: public again).
  BasicOperation& set_extra_input_channel(int64_t index, std::optional<std::string> channel);
  const std::vector<std::optional<std::string>>& extra_input_channels() const {
    return input_channels_;
  }
  const std::vector<OutputChannel>& extra_output_channels() const { return output_channels_; }
  /// How many tensors the op casts to FP8 under an FP8 autocast: (forward, backward), te.ops'
  /// num_quantizers("forward") and ("backward").
  virtual std::pair<int64_t, int64_t> num_quantizers() const { return {0, 0}; }
  /// The op's settings that fusion decisions read (e.g. cache_quantized_input, which epilogue
  /// fusions decline): a fuser re-plans when they change.
  virtual int64_t plan_settings() const { return 0; }
  /// The FP8 cast for a forward now, on the device of `like` (makes the delayed-scaling state
  /// under a DelayedScaling autocast).
  Fp8Cast fp8_cast(const at::Tensor& like) {
    auto cast = current_fp8_cast(&fp8_state_, num_quantizers(), like.device());
    if (cast.on()) fp8_recipe_ = cast.recipe;
    return cast;
  }
  /// fp8_cast for GEMMs over `rows` rows (tokens): off where the recipe's min_tokens asks for
  /// more (the op then computes as without FP8, forward and backward).
  Fp8Cast fp8_cast(const at::Tensor& like, int64_t rows) {
    auto cast = fp8_cast(like);
    if (cast.on() && rows < cast.recipe->min_tokens) return {};
    return cast;
  }
  /// The recipe of the op's latest forward under an FP8 autocast (or of reset_fp8_state).
  const std::shared_ptr<const Fp8Recipe>& fp8_recipe() const { return fp8_recipe_; }
  /// te.ops' reset_recipe_state: fresh quantizer state for `recipe` (null clears it) on device.
  void reset_fp8_state(std::shared_ptr<const Fp8Recipe> recipe, c10::Device device);
  /// The delayed-scaling state (null before the first forward under DelayedScaling).
  const std::shared_ptr<Fp8OpState>& fp8_state() const { return fp8_state_; }
  void set_fp8_state(std::shared_ptr<Fp8OpState> state) { fp8_state_ = std::move(state); }
  /// Both as they were before a call that raised (Fp8StateRollback).
  void restore_fp8(std::shared_ptr<Fp8OpState> state, std::shared_ptr<const Fp8Recipe> recipe) {
    fp8_state_ = std::move(state);
    fp8_recipe_ = std::move(recipe);
  }

  /// Whether a live persistent fuser holds this op's routing.
  bool channels_locked() const { return channel_locks_ > 0; }
  /// Changes whenever a channel setter succeeds (throw-away fusers re-route on a change).
  int64_t routing_version() const { return routing_version_; }
  /// Called by persistent fusers: count holders, since an op may sit in two models.
  void lock_channels() { ++channel_locks_; }
  void unlock_channels() { --channel_locks_; }

 private:
  void check_channel_index(const char* what, int64_t index, int64_t size) const;

  std::string type_name_;
  int64_t num_extra_inputs_;
  int64_t num_extra_outputs_;
  std::vector<std::optional<std::string>> input_channels_;
  std::vector<OutputChannel> output_channels_;
  std::atomic<int64_t> channel_locks_{0};
  int64_t routing_version_ = 0;
  std::shared_ptr<Fp8OpState> fp8_state_;
  std::shared_ptr<const Fp8Recipe> fp8_recipe_;
  std::optional<ProcessGroupSpec> param_grad_reduction_;
};

/// Runs several basic ops as one. Composite ops (Linear) are fused ops that the fuser flattens.
class FusedOperation : public FusibleOperation {
 public:
  FusedOperation(std::string type_name, std::vector<std::shared_ptr<BasicOperation>> basic_ops);

  std::string type_name() const override { return type_name_; }
  bool is_fused() const override { return true; }
  std::vector<std::shared_ptr<BasicOperation>> basic_ops() override { return basic_ops_; }

  /// Default: the basic ops' own forwards in order (a composite that is never fused still runs).
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  /// Default: the basic ops' own backwards in reverse.
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

  void reset_parameters() override;
  void pre_first_forward(const at::Tensor& input) override;
  void train(bool on = true) override;
  bool takes_input_amax() const override {
    return !basic_ops_.empty() && basic_ops_.front()->takes_input_amax();
  }
  bool takes_input_act() const override {
    return input_through_front_op_ && basic_ops_.front()->takes_input_act();
  }
  bool fuses_forward() const override { return fuses_forward_; }
  bool fuses_backward() const override { return fuses_backward_; }

 protected:
  /// For fused ops that implement only one direction (forward-only or backward-only fusions).
  void set_fused_directions(bool forward, bool backward) {
    fuses_forward_ = forward;
    fuses_backward_ = backward;
  }

  /// For fused forwards that hand their input only to the first basic op's forward preparation
  /// (BasicLinear::prepare_forward, which resolves a deferred activation): takes_input_act then
  /// answers for that op.
  void set_input_through_front_op() { input_through_front_op_ = !basic_ops_.empty(); }

  std::vector<std::shared_ptr<BasicOperation>> basic_ops_;
  bool fuses_forward_ = true;
  bool fuses_backward_ = true;
  bool input_through_front_op_ = false;

 private:
  std::string type_name_;
};

/// torch::nn::Module::clone() of a basic op class: a deep copy (own parameters, same channels).
template <typename Op>
std::shared_ptr<torch::nn::Module> clone_basic_op(const Op& op,
                                                  const std::optional<c10::Device>& device) {
  auto copy = std::make_shared<Op>(op);
  copy->own_parameter_copies(device);
  return copy;
}

/// Declares clone() in a basic op class (which needs a copy constructor).
#define FUSIBLE_CLONEABLE_OP                                                          \
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& device = \
                                               std::nullopt) const override {         \
    return ::fusible::ops::clone_basic_op(*this, device);                             \
  }

/// ForwardArgs for a call whose input is `input` (torch.autocast state of its device).
ForwardArgs forward_args_for(const at::Tensor& input);

/// The dtype an op with parameters computes in: autocast's when on, else the parameter's.
inline at::ScalarType compute_dtype(const ForwardArgs& args, at::ScalarType param_dtype) {
  return args.autocast_dtype.value_or(param_dtype);
}

/// t in dtype (no copy when it already is).
inline at::Tensor cast_to(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t : t.to(dtype);
}

}  // namespace fusible::ops

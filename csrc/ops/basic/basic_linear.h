// BasicLinear: y = x W^T, no bias (Linear composes it with Bias).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "kernels/dispatch.h"
#include "ops/distributed.h"
#include "ops/fusible_operation.h"
#include "ops/linear_gemms.h"

namespace fusible::ops {

/// te.ops' accumulate_into_main_grad (Megatron's `weight.main_grad`) as a linear's backward sees
/// it: `target()` returns the buffer the weight gradient goes into instead of autograd (raising
/// where the weight has none) and whether it is overwritten rather than added to; `result()`
/// what autograd then gets as the weight's gradient (nullopt: none).
struct MainGrad {
  std::function<std::pair<at::Tensor, bool>()> target;
  std::function<std::optional<at::Tensor>()> result;
};

/// One forward's main_grad routing, as its backward follows it: the hook and the parameter
/// gradient reduction in effect at the forward.
struct MainGradCall {
  std::shared_ptr<const MainGrad> hook;
  std::optional<ProcessGroupSpec> reduction;
};

/// te.ops' tensor parallelism of a linear. "column": the weight's output rows are sharded over the
/// group, the output is this rank's slice of features (with sequence_parallel, the input is first
/// all-gathered along dim 0); "row": the input columns are sharded, the output is all-reduced
/// (reduce-scattered along dim 0 with sequence_parallel). The backward runs the adjoints.
struct TensorParallel {
  std::string mode;  // "", "column" or "row"
  ProcessGroupSpec group;
  bool sequence_parallel = false;
};

/// tp checked for a linear of the global sizes (`op` names the op in errors): a bad mode,
/// sequence_parallel alone or a sharded dim the group size does not divide is a ValueError; over
/// one process it is no tensor parallelism (te.ops' canonicalization).
TensorParallel checked_tensor_parallel(const char* op, TensorParallel tp, int64_t in_features,
                                       int64_t out_features);

/// Parameter `weight` [out_features, in_features], kaiming-uniform(a=sqrt(5)) like torch.nn.Linear;
/// with tensor parallelism, this rank's shard of the global [out_features, in_features].
class BasicLinear : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  /// in_features, out_features: the global sizes (te.ops' convention).
  BasicLinear(int64_t in_features, int64_t out_features,
              std::optional<c10::Device> device = std::nullopt,
              std::optional<at::ScalarType> dtype = std::nullopt, TensorParallel tp = {});
  /// The local sizes (this rank's shard; the global ones without tensor parallelism).
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  const TensorParallel& tensor_parallel() const { return tp_; }
  /// Whether collectives run in this op (fusions built for local GEMMs decline it).
  bool is_tensor_parallel() const { return !tp_.mode.empty(); }
  /// "BasicLinear", or with its collectives: "BasicLinear[all-gather input]" (column + sequence
  /// parallel forward), "BasicLinear[all-reduce dgrad, overlapped]" (column backward), ...
  std::string plan_label(bool backward) const override;
  bool takes_input_amax() const override;
  bool takes_input_act() const override;
  /// The registered weight (a call computes with the call's own, OperationContext::params).
  const at::Tensor& weight() const { return *parameters_.find("weight"); }
  void reset_parameters() override;
  /// Megatron's weight.main_grad (te.ops' accumulate_into_main_grad): the backward's wgrad GEMM
  /// adds the weight gradient into main_grad.target()'s buffer (fp32 accumulation for an fp32
  /// buffer, as TransformerEngine's) and autograd gets main_grad.result(). With a parameter
  /// gradient reduction (set_param_grad_reduction) at the forward, the gradient is computed in
  /// the buffer's dtype, summed over the group, then added. A fused backward that computes the
  /// weight gradient itself (not through backward_gemms) handles main_grad itself, as in te.ops.
  /// nullopt: off.
  void set_main_grad_hook(std::optional<MainGrad> main_grad);
  bool accumulates_into_main_grad() const { return main_grad_ != nullptr; }
  std::pair<int64_t, int64_t> num_quantizers() const override { return {2, 1}; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  /// Checks x, fills ctx as the forward does (compute dtype, FP8 cast, saved tensors) and returns
  /// (x, weight) as the GEMMs take them (ops/linear_gemms.h); fused forwards call this so the
  /// backward stays valid.
  std::pair<GemmOperand, GemmOperand> prepare_forward(OperationContext& ctx, const at::Tensor& x,
                                                      const ForwardArgs& args);
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;
  /// The backward's GEMMs for dy (in the compute dtype) on a context this op's forward filled:
  /// the wgrad (scaled by alpha) first, so the saved input is released before dx is allocated,
  /// then dx = dgrad(dy, w) where the input needs a gradient (fused ops pass an epilogue GEMM from
  /// ops/linear_gemms.h). dy is cast as the forward's FP8 recipe says. dgrad_first: the dgrad
  /// runs first instead (a tensor-parallel linear starts dx's reduction there and the wgrad
  /// overlaps it). The weight gradient goes into main_grad where the forward routed it, or, after
  /// a forward that left no routing (a Python fusion's), where this op routes it now.
  /// -> (dx, dw), each undefined where not needed.
  template <typename Dgrad>
  std::pair<at::Tensor, at::Tensor> backward_gemms(OperationContext& ctx, const at::Tensor& dy_in,
                                                   double alpha, Dgrad&& dgrad,
                                                   bool dgrad_first = false) const {
    route_main_grad(ctx);
    at::Tensor dx, dw;
    const auto x = saved_input(ctx);
    const auto w = saved_weight(ctx);
    const bool need_dw = x.columnwise.defined();
    const bool need_dx = w.rowwise.defined() || w.columnwise.defined();
    const auto dy = ctx.fp8.backward_operand(dy_in, 0, need_dx, need_dw,
                                             ctx.grad_output_amax.for_tensor(dy_in));
    if (dgrad_first && need_dx) dx = dgrad(dy, w);
    if (need_dw && ctx.main_grad) {
      dw = wgrad_into_main_grad(*ctx.main_grad, dy, x, alpha);
      ctx.param_grads_reduced = ctx.main_grad->reduction.has_value();
    } else if (need_dw) {
      dw = gemms::wgrad(dy, x, alpha);
    }
    ctx.release_saved_tensor(0);
    if (!dgrad_first && need_dx) dx = dgrad(dy, w);
    return {dx, dw};
  }

 private:
  // ctx's main_grad routing where its forward left none: this op's hook and reduction now.
  void route_main_grad(OperationContext& ctx) const;
  // alpha * dy^T x added into (or written over) the main-grad buffer by the GEMM -> what autograd
  // gets for the weight.
  static at::Tensor wgrad_into_main_grad(const MainGradCall& call, const GemmOperand& dy,
                                         const GemmOperand& x, double alpha);
  // x's last dim is in_features (checked on the input as given, before any all-gather).
  void check_input_features(const at::Tensor& x) const;
  // The wgrad's x and the dgrad's w as prepare_forward saved them.
  static GemmOperand saved_input(const OperationContext& ctx);
  static GemmOperand saved_weight(const OperationContext& ctx);

 private:
  at::Tensor tensor_parallel_forward(OperationContext& ctx, const at::Tensor& x,
                                     const ForwardArgs& args);
  std::pair<at::Tensor, std::vector<at::Tensor>> tensor_parallel_backward(OperationContext& ctx,
                                                                          const at::Tensor& dy);

  int64_t in_features_;
  int64_t out_features_;
  TensorParallel tp_;
  std::shared_ptr<const MainGrad> main_grad_;
};

}  // namespace fusible::ops

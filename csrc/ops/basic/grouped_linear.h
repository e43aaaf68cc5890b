// GroupedLinear (te.ops): the rows of x split into num_groups consecutive groups by split sizes
// (extra input 0); group g computes y_g = x_g W_g^T (+ b_g), as one torch.nn.Linear per group
// over its rows.
#pragma once

#include <functional>
#include <optional>
#include <vector>

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// Parameters weight0..weight{N-1} [out_features, in_features] (kaiming-uniform as
/// torch.nn.Linear), then bias0..bias{N-1} [out_features] (zeros) with bias. The split sizes: a 1-D
/// int32 or int64 tensor of num_groups non-negative entries summing to x's row count. With
/// scale_bias (and bias), extra input 1 is a per-row scale [rows] and each row adds
/// bias_g * its scale (te.ops' MoE probabilities); the scales get a gradient.
///
/// This first version runs one GEMM per non-empty group and reads the split sizes on the host (on
/// CUDA: a synchronization); issue 15's grouped GEMM replaces both.
class GroupedLinear : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  GroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features, bool bias = true,
                std::optional<c10::Device> device = std::nullopt,
                std::optional<at::ScalarType> dtype = std::nullopt, bool scale_bias = false);
  int64_t num_groups() const { return num_groups_; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool has_bias() const { return has_bias_; }
  bool scale_bias() const { return scale_bias_; }
  /// Megatron's main_grad per weight (te.ops' accumulate_into_main_grad): the backward hands
  /// weight g's gradient to hook(g, dw), which returns what autograd gets (nullopt: none).
  using MainGradHook = std::function<std::optional<at::Tensor>(int64_t group, const at::Tensor&)>;
  void set_main_grad_hook(MainGradHook hook) { main_grad_hook_ = std::move(hook); }
  at::Tensor take_param_grad(size_t index, const at::Tensor& grad) override;
  void reset_parameters() override;
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 private:
  /// The split sizes checked against `rows`, on the host.
  std::vector<int64_t> split_sizes(const at::Tensor& sizes, int64_t rows) const;

  int64_t num_groups_, in_features_, out_features_;
  bool has_bias_, scale_bias_;
  MainGradHook main_grad_hook_;
};

}  // namespace fusible::ops

// GroupedLinear (te.ops): the rows of x split into num_groups consecutive groups by split sizes
// (extra input 0); group g computes y_g = x_g W_g^T (+ b_g), as one torch.nn.Linear per group
// over its rows.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// Parameters weight0..weight{N-1} [out_features, in_features] (kaiming-uniform as
/// torch.nn.Linear), then bias0..bias{N-1} [out_features] (zeros) with bias; or, with
/// single_grouped_weight / single_grouped_bias, one `weight` [N, out, in] / `bias` [N, out]. The
/// per-group parameters are slices of one buffer, so the grouped GEMM reads them in place (a
/// swapped or moved parameter is gathered per call instead). The split sizes: a 1-D int32 or int64
/// tensor of num_groups non-negative entries summing to x's row count; on CUDA they stay on the
/// device (checked there: no host synchronization). With scale_bias (and bias), extra input 1 is a
/// per-row scale [rows] and each row adds bias_g * its scale (te.ops' MoE probabilities); the
/// scales get a gradient.
class GroupedLinear : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  GroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features, bool bias = true,
                std::optional<c10::Device> device = std::nullopt,
                std::optional<at::ScalarType> dtype = std::nullopt, bool scale_bias = false,
                bool single_grouped_weight = false, bool single_grouped_bias = false);
  int64_t num_groups() const { return num_groups_; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool has_bias() const { return has_bias_; }
  bool scale_bias() const { return scale_bias_; }
  bool single_grouped_weight() const { return single_weight_; }
  bool single_grouped_bias() const { return single_bias_; }
  /// Megatron's main_grad per weight parameter (te.ops' accumulate_into_main_grad), as
  /// BasicLinear's MainGrad with weight parameter i (the group, or 0 for the single grouped
  /// weight) passed to each callback: each group's wgrad GEMM adds into target(i)'s buffer (its
  /// slice g of a single grouped weight's), in the buffer's precision, and autograd gets
  /// result(i). With a parameter gradient reduction the gradients are computed in the compute
  /// dtype, summed, then added. nullopt: off.
  struct MainGrad {
    std::function<std::pair<at::Tensor, bool>(int64_t)> target;
    std::function<std::optional<at::Tensor>(int64_t)> result;
  };
  void set_main_grad_hook(std::optional<MainGrad> hook);
  at::Tensor take_param_grad(size_t index, const at::Tensor& grad) override;
  void reset_parameters() override;
  bool materialize_meta_parameters(c10::Device device) override;
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

  // The pieces fused ops compose (GroupedMLP_GroupedGEMMGLU):
  /// fuser_forward's work; keep_input = false leaves the input for the weight gradient unsaved
  /// (the caller hands it to param_grads). With a caller's "output" buffer (ops/call_buffers.h)
  /// the output is written there and that buffer returned. host_sizes: where given, the split
  /// sizes on the host that FP8 reads (a fused op's earlier read of the same sizes tensor in the
  /// same call: no second wait for the device); empty, it receives them.
  at::Tensor forward(OperationContext& ctx, const at::Tensor& input,
                     const std::vector<at::Tensor>& extra_inputs, const ForwardArgs& args,
                     bool keep_input = true, std::vector<int64_t>* host_sizes = nullptr);
  /// dy [rows, out] as the backward takes it: `dgrad` and `wgrad`, the GEMMs' operands (under
  /// the forward's FP8 recipe cast per group, each group with its own quantizer: made once per
  /// backward, a delayed-scaling history advances once), and `dy` itself for the bias.
  /// With FP8 GEMMs per group (fp8_gemms_fit): `groups` holds each group's cast gradient
  /// (undefined for an empty group) and `sizes` the split sizes; dgrad and wgrad stay undefined.
  struct Grad {
    at::Tensor dy, dgrad, wgrad;
    std::vector<GemmOperand> groups;
    std::vector<int64_t> sizes;
  };
  Grad grad_operands(const OperationContext& ctx, const at::Tensor& dy) const;
  /// dx [rows, in] (undefined when the input needs no gradient); written into the caller's
  /// grad_input buffer and that buffer returned (in x's shape) where the forward was handed one
  /// (ops/call_buffers.h).
  at::Tensor input_grad(const OperationContext& ctx, const Grad& dy) const;
  /// The parameter gradients and (scale_bias) the scales' gradient from dy and the forward's
  /// input x [rows, in] in the compute dtype (undefined: the one the forward kept, which it does
  /// under FP8 whatever keep_input said).
  std::pair<std::vector<at::Tensor>, at::Tensor> param_grads(const OperationContext& ctx,
                                                             const Grad& dy,
                                                             const at::Tensor& x) const;
  /// te.ops' quantizers: per group its input and its weight forward, its gradient backward.
  std::pair<int64_t, int64_t> num_quantizers() const override {
    return {2 * num_groups_, num_groups_};
  }

 private:
  int64_t num_weight_params() const { return single_weight_ ? 1 : num_groups_; }
  int64_t num_bias_params() const { return has_bias_ ? (single_bias_ ? 1 : num_groups_) : 0; }
  /// The call's weights as one [N, out, in] tensor (bias: [N, out]) from the single grouped
  /// parameter `first` (single) or the N per-group ones from `first` on, in place when they are
  /// slices of one buffer.
  at::Tensor grouped_param(const OperationContext& ctx, int64_t first, bool single,
                           const char* name, c10::IntArrayRef shape) const;
  /// Checks the split sizes' metadata (dtype, shape) and puts them on x's device.
  at::Tensor split_sizes_for(const at::Tensor& sizes, const at::Tensor& x) const;
  /// Under FP8 (emulated): the weights [N, out, in] as the forward GEMMs see them, each group's
  /// parameter (an FP8 weight as it is stored) cast by its own quantizer, and as the dgrad sees
  /// them where `dgrad`: the same, or under block scaling with 1x128 weight blocks, each weight's
  /// column-wise cast (128x1 blocks). Undefined second where not `dgrad`.
  std::pair<at::Tensor, at::Tensor> fp8_weights(OperationContext& ctx, bool dgrad) const;
  /// The weights as one [N * out, in] tensor in the compute dtype for a grouped FP8 cast, or
  /// undefined where one is a tensor subclass (an FP8 weight hands its own cast its stored data).
  at::Tensor grouped_cast_weights(const OperationContext& ctx) const;
  /// Group g's weight parameter [out, in] of this call (checked).
  at::Tensor weight_of(const OperationContext& ctx, int64_t g) const;
  /// Under an FP8 autocast (`cast` on): whether the GEMMs run on FP8 data, one cuBLASLt FP8 GEMM
  /// per group (per-tensor recipes; every group's rows, in_features and out_features multiples of
  /// 16 (te.ops' MoE pads the groups so, with Fp8Padding); no per-row bias scales). Else the casts
  /// are emulated and the grouped GEMM runs in the compute dtype. (grouped_linear_fp8.cpp)
  bool fp8_gemms_fit(const Fp8Cast& cast, const std::vector<int64_t>& sizes, at::ScalarType dtype,
                     c10::Device device) const;
  /// The forward's FP8 GEMMs, one per group: y [rows, out]. Saves, after the five slots every
  /// forward saves, each group's x^T then each group's W^T as FP8 (kFp8Slots; under current
  /// scaling views of one grouped cast's transposes, which stay alive together), and host_sizes.
  at::Tensor fp8_forward(OperationContext& ctx, const at::Tensor& x, const at::Tensor& sizes,
                         const std::vector<int64_t>& host_sizes, const at::Tensor& bias,
                         bool need_x);
  /// The backward's FP8 GEMMs per group: dx [rows, in]; dW per group ([out, in]; zeros for an
  /// empty group, undefined for a per-group weight that needs no gradient).
  at::Tensor fp8_input_grad(const OperationContext& ctx, const Grad& grad) const;
  std::vector<at::Tensor> fp8_weight_grads(const OperationContext& ctx, const Grad& grad) const;
  /// Group g's weight gradient added into buffers[g].first (written over it where .second), for
  /// each g with a defined buffer: by its FP8 GEMM (grouped_linear_fp8.cpp) or, else, one GEMM of
  /// its rows of dy and x (split by sizes).
  using MainGradBuffers = std::vector<std::pair<at::Tensor, bool>>;
  void fp8_weight_grads_into(const OperationContext& ctx, const Grad& grad,
                             const MainGradBuffers& buffers) const;
  void weight_grads_into(const Grad& grad, const at::Tensor& x, const std::vector<int64_t>& sizes,
                         const MainGradBuffers& buffers) const;
  /// The split sizes where the host has them without waiting for the device (read by the
  /// backward's casts, or a CPU tensor); nullopt otherwise.
  std::optional<std::vector<int64_t>> host_sizes_at_hand(const OperationContext& ctx,
                                                         const Grad& grad) const;
  /// The weight gradients into main_grad (param_grads' route with a hook and no reduction), one
  /// GEMM per group where the split sizes are on the host; with them on the device (bf16 on
  /// CUDA) the grouped GEMM's, added after. grads[i] receives what autograd gets for weight
  /// parameter i.
  void weight_grads_into_main_grad(const OperationContext& ctx, const Grad& grad,
                                   const at::Tensor& x, std::vector<at::Tensor>& grads) const;
  /// Saved slot of group g's x^T (and, + num_groups, of its W^T) under FP8 GEMMs; after them, the
  /// split sizes on the host.
  static constexpr int64_t kFp8Slots = 5;
  int64_t fp8_host_sizes_slot() const { return kFp8Slots + 2 * num_groups_; }

  int64_t num_groups_, in_features_, out_features_;
  bool has_bias_, scale_bias_, single_weight_, single_bias_;
  std::shared_ptr<const MainGrad> main_grad_;
};

}  // namespace fusible::ops

// Linear: the composite BasicLinear + Bias that the fuser flattens, tensor-parallel decomposition
// included (one for C++ and Python). `weight` and `bias` are the basic ops' own tensors, so state
// dicts use torch.nn.Linear's keys.
#pragma once

#include <tuple>

#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/fusible_operation.h"

namespace fusible::ops {

/// Where a row-parallel Linear adds its bias.
enum class RowParallelBias {
  /// Megatron-LM's RowParallelLinear: one bias [out_features], replicated on every rank, added
  /// once after the reduction; its gradient is the full bias gradient on every rank (summed over
  /// the group under sequence parallelism), so training equals the single-process model's.
  kReplicated,
  /// te.ops' layout: each rank adds a bias summand [out_features] before the reduction (the
  /// effective bias is the sum over ranks, and each summand gets the full gradient, so the
  /// effective bias moves world_size times as far per step). Only to reproduce te.ops' numbers.
  kPerRankSummand,
};

class Linear : public FusedOperation {
 public:
  /// in_features, out_features: the global sizes. tp: none, column (BasicLinear(column) + this
  /// rank's slice of the bias) or row (see RowParallelBias); over one process it is none.
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         std::optional<c10::Device> device = std::nullopt,
         std::optional<at::ScalarType> dtype = std::nullopt, TensorParallel tp = {},
         RowParallelBias row_parallel_bias = RowParallelBias::kReplicated);
  /// A Linear over existing basic ops (a copy rebuilding its composite); bias and collective (an
  /// AllReduce or ReduceScatter after the bias: te.ops' summand layout) may be null.
  Linear(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
         std::shared_ptr<BasicOperation> collective = nullptr);
  std::shared_ptr<BasicLinear> linear_op() const { return linear_; }
  /// Null without bias.
  std::shared_ptr<Bias> bias_op() const { return bias_; }
  /// The reduction after a per-rank bias summand (null otherwise).
  std::shared_ptr<BasicOperation> collective_op() const { return collective_; }
  /// Read-only: parameters() holds this tensor too (replace its data with set_data or copy_).
  const at::Tensor& weight() const { return linear_->weight(); }
  /// A deep copy over copies of the basic ops.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override;

 private:
  using Parts = std::tuple<std::shared_ptr<BasicLinear>, std::shared_ptr<Bias>,
                           std::shared_ptr<BasicOperation>>;
  explicit Linear(Parts parts)
      : Linear(std::get<0>(parts), std::get<1>(parts), std::get<2>(parts)) {}

  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<Bias> bias_;
  std::shared_ptr<BasicOperation> collective_;
};

}  // namespace fusible::ops

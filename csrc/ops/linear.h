// Linear: the composite BasicLinear + Bias (+ the output's collective for row tensor parallelism,
// te.ops' layout) that the fuser flattens. `weight` and `bias` are the basic ops' own tensors, so
// state dicts use torch.nn.Linear's keys.
#pragma once

#include "ops/basic/basic_linear.h"
#include "ops/basic/bias.h"
#include "ops/fusible_operation.h"

namespace fusible::ops {

class Linear : public FusedOperation {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         std::optional<c10::Device> device = std::nullopt,
         std::optional<at::ScalarType> dtype = std::nullopt);
  /// A Linear over existing basic ops (a copy rebuilding its composite); bias and collective (an
  /// AllReduce or ReduceScatter after the bias) may be null.
  Linear(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
         std::shared_ptr<BasicOperation> collective = nullptr);
  std::shared_ptr<BasicLinear> linear_op() const { return linear_; }
  /// Null without bias.
  std::shared_ptr<Bias> bias_op() const { return bias_; }
  at::Tensor& weight() { return linear_->weight(); }
  /// A deep copy over copies of the basic ops.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<c10::Device>& device = std::nullopt) const override;

 private:
  std::shared_ptr<BasicLinear> linear_;
  std::shared_ptr<Bias> bias_;
  std::shared_ptr<BasicOperation> collective_;
};

}  // namespace fusible::ops

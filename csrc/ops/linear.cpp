// Linear composite and its tensor-parallel decomposition.
#include "ops/linear.h"

#include "ops/basic/collectives.h"

namespace fusible::ops {
namespace {

std::vector<std::shared_ptr<BasicOperation>> make_basic_list(
    std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
    std::shared_ptr<BasicOperation> collective) {
  TORCH_CHECK_VALUE(linear != nullptr, "Linear: expected a BasicLinear, got null");
  std::vector<std::shared_ptr<BasicOperation>> ops{linear};
  if (bias) ops.push_back(bias);
  if (collective) ops.push_back(collective);
  return ops;
}

// The basic ops of a Linear: (linear, bias, collective after the bias).
std::tuple<std::shared_ptr<BasicLinear>, std::shared_ptr<Bias>, std::shared_ptr<BasicOperation>>
decompose(int64_t in_features, int64_t out_features, bool has_bias,
          std::optional<c10::Device> device, std::optional<at::ScalarType> dtype, TensorParallel tp,
          RowParallelBias row_bias) {
  tp = checked_tensor_parallel("Linear", std::move(tp), in_features, out_features);
  if (tp.mode == "row" && has_bias && row_bias == RowParallelBias::kPerRankSummand) {
    // te.ops: a local GEMM, the bias summand, then the reduction as an op of its own.
    std::shared_ptr<BasicOperation> reduce;
    if (tp.sequence_parallel) {
      reduce = std::make_shared<ReduceScatter>(tp.group);
    } else {
      reduce = std::make_shared<AllReduce>(tp.group);
    }
    return {std::make_shared<BasicLinear>(in_features / tp.group.size, out_features, device, dtype),
            std::make_shared<Bias>(out_features, device, dtype), std::move(reduce)};
  }
  const bool row_sp = tp.mode == "row" && tp.sequence_parallel;
  const auto group = tp.group;
  // Row parallel: BasicLinear reduces its output; the bias comes after, once.
  auto linear =
      std::make_shared<BasicLinear>(in_features, out_features, device, dtype, std::move(tp));
  std::shared_ptr<Bias> bias;
  if (has_bias) {
    bias = std::make_shared<Bias>(linear->out_features(), device, dtype);
    // Each rank sees its own rows of the reduce-scattered output: sum the bias gradient.
    if (row_sp) bias->set_param_grad_reduction(group);
  }
  return {std::move(linear), std::move(bias), nullptr};
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias,
               std::optional<c10::Device> device, std::optional<at::ScalarType> dtype,
               TensorParallel tp, RowParallelBias row_parallel_bias)
    : Linear(decompose(in_features, out_features, bias, device, dtype, std::move(tp),
                       row_parallel_bias)) {}

Linear::Linear(std::shared_ptr<BasicLinear> linear, std::shared_ptr<Bias> bias,
               std::shared_ptr<BasicOperation> collective)
    : FusedOperation("Linear", make_basic_list(linear, bias, collective)),
      linear_(std::move(linear)),
      bias_(std::move(bias)),
      collective_(std::move(collective)) {
  TORCH_CHECK_VALUE(!bias_ || bias_->size() == linear_->out_features(), "Linear: expected a bias ",
                    "of size out_features (", linear_->out_features(), "), got ", bias_->size());
  // Own names for the basic ops' tensors: the same objects, torch.nn.Linear's state-dict keys.
  register_parameter("weight", linear_->weight(), linear_->weight().requires_grad());
  if (bias_) register_parameter("bias", bias_->bias(), bias_->bias().requires_grad());
}

std::shared_ptr<torch::nn::Module> Linear::clone(const std::optional<c10::Device>& device) const {
  auto linear = std::static_pointer_cast<BasicLinear>(linear_->clone(device));
  auto bias = bias_ ? std::static_pointer_cast<Bias>(bias_->clone(device)) : nullptr;
  auto collective =
      collective_ ? std::static_pointer_cast<BasicOperation>(collective_->clone(device)) : nullptr;
  return std::make_shared<Linear>(std::move(linear), std::move(bias), std::move(collective));
}

}  // namespace fusible::ops

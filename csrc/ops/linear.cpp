// Linear composite.
#include "ops/linear.h"

namespace fusible::ops {
namespace {

std::vector<std::shared_ptr<BasicOperation>> make_linear_ops(int64_t in_features,
                                                             int64_t out_features, bool bias,
                                                             std::optional<c10::Device> device,
                                                             std::optional<at::ScalarType> dtype) {
  std::vector<std::shared_ptr<BasicOperation>> ops{
      std::make_shared<BasicLinear>(in_features, out_features, device, dtype)};
  if (bias) ops.push_back(std::make_shared<Bias>(out_features, device, dtype));
  return ops;
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias,
               std::optional<c10::Device> device, std::optional<at::ScalarType> dtype)
    : FusedOperation("Linear", make_linear_ops(in_features, out_features, bias, device, dtype)) {
  linear_ = std::static_pointer_cast<BasicLinear>(basic_ops_[0]);
  // Own names for the basic ops' tensors: the same objects, torch.nn.Linear's state-dict keys.
  register_parameter("weight", linear_->weight(), linear_->weight().requires_grad());
  if (bias) {
    bias_ = std::static_pointer_cast<Bias>(basic_ops_[1]);
    register_parameter("bias", bias_->bias(), bias_->bias().requires_grad());
  }
}

void Linear::replace_parameter(const std::string& name, const at::Tensor& value) {
  auto* slot = parameters_.find(name);
  TORCH_CHECK_VALUE(slot != nullptr, "Linear: has no parameter '", name, "'");
  (name == "weight" ? std::static_pointer_cast<BasicOperation>(linear_)
                    : std::static_pointer_cast<BasicOperation>(bias_))
      ->replace_parameter(name, value);
  *slot = value;
}

}  // namespace fusible::ops

// Normalizations: LayerNorm and RMSNorm over trailing dims (with weights), L2Normalization over the
// last dim (no weights).
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// Parameters `weight` (ones, or zeros with zero_centered_gamma) and `bias` (zeros), both of
/// normalized_shape. With zero_centered_gamma the scale applied is (1 + weight).
class LayerNorm : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  LayerNorm(std::vector<int64_t> normalized_shape, double eps = 1e-5,
            std::optional<c10::Device> device = std::nullopt,
            std::optional<at::ScalarType> dtype = std::nullopt, bool zero_centered_gamma = false);
  const std::vector<int64_t>& normalized_shape() const { return normalized_shape_; }
  double eps() const { return eps_; }
  bool zero_centered_gamma() const { return zero_centered_gamma_; }
  const at::Tensor& weight() const { return *parameters_.find("weight"); }
  const at::Tensor& bias() const { return *parameters_.find("bias"); }
  void reset_parameters() override;
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::vector<int64_t> normalized_shape_;
  double eps_;
  bool zero_centered_gamma_;
};

/// y = x * rsqrt(mean(x^2) + eps) * weight, over the trailing normalized_shape dims.
class RMSNorm : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  RMSNorm(std::vector<int64_t> normalized_shape, double eps = 1e-5,
          std::optional<c10::Device> device = std::nullopt,
          std::optional<at::ScalarType> dtype = std::nullopt, bool zero_centered_gamma = false);
  const std::vector<int64_t>& normalized_shape() const { return normalized_shape_; }
  double eps() const { return eps_; }
  bool zero_centered_gamma() const { return zero_centered_gamma_; }
  const at::Tensor& weight() const { return *parameters_.find("weight"); }
  void reset_parameters() override;
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::vector<int64_t> normalized_shape_;
  double eps_;
  bool zero_centered_gamma_;
};

/// y = x * rsqrt(sum(x^2) + eps) over the last dim.
class L2Normalization : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit L2Normalization(double eps = 1e-6);
  double eps() const { return eps_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  double eps_;
};

}  // namespace fusible::ops

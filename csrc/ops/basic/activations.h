// Activations: elementwise (GELU, QGELU, ReLU, SReLU, SiLU), gated on halves of the last dim
// (GLU, GEGLU, QGEGLU, ReGLU, SReGLU, SwiGLU), ClampedSwiGLU and ScaledSwiGLU (scales as extra
// input).
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// y = act(x), computed in the input's dtype (autocast's when on).
class ElementwiseActivation : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  ElementwiseActivation(std::string type_name, std::string kind)
      : BasicOperation(std::move(type_name)), kind_(std::move(kind)) {}
  /// Kernel kind: gelu, qgelu, relu, srelu or silu.
  const std::string& kind() const { return kind_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  /// Fills ctx as the forward does, for a fused forward that computed (x, y = act(x)) itself in
  /// the compute dtype: saves x, or y for ReLU (whose derivative [x > 0] is [y > 0]: a GEMM
  /// epilogue need not keep x). x may be undefined for ReLU.
  void fill_context(OperationContext& ctx, const at::Tensor& x, const at::Tensor& y,
                    const ForwardArgs& args);
  /// Whether the backward reads the output (ReLU) rather than the input.
  bool saves_output() const { return kind_ == "relu"; }
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::string kind_;
};

/// x = [a, b] on the last dim; y = act(a) * b (the first half is gated).
class GatedActivation : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  GatedActivation(std::string type_name, std::string kind)
      : BasicOperation(std::move(type_name)), kind_(std::move(kind)) {}
  /// Kernel kind: glu, geglu, qgeglu, reglu, sreglu or swiglu.
  const std::string& kind() const { return kind_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::string kind_;
};

#define FUSIBLE_ACTIVATION_CLASS(Name, Base, kind) \
  class Name : public Base {                       \
   public:                                         \
    FUSIBLE_CLONEABLE_OP                           \
    Name() : Base(#Name, kind) {}                  \
  };

FUSIBLE_ACTIVATION_CLASS(GELU, ElementwiseActivation, "gelu")
FUSIBLE_ACTIVATION_CLASS(QGELU, ElementwiseActivation, "qgelu")
FUSIBLE_ACTIVATION_CLASS(ReLU, ElementwiseActivation, "relu")
FUSIBLE_ACTIVATION_CLASS(SReLU, ElementwiseActivation, "srelu")
FUSIBLE_ACTIVATION_CLASS(SiLU, ElementwiseActivation, "silu")
FUSIBLE_ACTIVATION_CLASS(GLU, GatedActivation, "glu")
FUSIBLE_ACTIVATION_CLASS(GEGLU, GatedActivation, "geglu")
FUSIBLE_ACTIVATION_CLASS(QGEGLU, GatedActivation, "qgeglu")
FUSIBLE_ACTIVATION_CLASS(ReGLU, GatedActivation, "reglu")
FUSIBLE_ACTIVATION_CLASS(SReGLU, GatedActivation, "sreglu")
FUSIBLE_ACTIVATION_CLASS(SwiGLU, GatedActivation, "swiglu")
#undef FUSIBLE_ACTIVATION_CLASS

/// GPT-OSS SwiGLU: a = min(a, limit), b = clamp(b, -limit, limit), y = a*sigmoid(alpha*a)*(b+1).
class ClampedSwiGLU : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ClampedSwiGLU(double limit = 7.0, double alpha = 1.702)
      : BasicOperation("ClampedSwiGLU"), limit_(limit), alpha_(alpha) {}
  double limit() const { return limit_; }
  double alpha() const { return alpha_; }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  double limit_;
  double alpha_;
};

/// y = scales[..., None] * swiglu(x); scales (extra input 0) has x's shape without the last dim.
class ScaledSwiGLU : public BasicOperation {
 public:
  FUSIBLE_CLONEABLE_OP
  ScaledSwiGLU() : BasicOperation("ScaledSwiGLU", /*num_extra_inputs=*/1) {}
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;
};

}  // namespace fusible::ops

// Activations: elementwise (GELU, QGELU, ReLU, SReLU, SiLU), gated on halves of the last dim
// (GLU, GEGLU, QGEGLU, ReGLU, SReGLU, SwiGLU, ClampedSwiGLU, SiTUGLU), and scaled by a per-row
// extra input (ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU, ScaledSReLU).
#pragma once

#include "ops/fusible_operation.h"

namespace fusible::ops {

/// te.ops' cache_quantized_input: the backward keeps the activation's input as E4M3 data with a
/// current-scaling scale (a byte per element) and computes the gradient from its dequantized
/// values, with or without an FP8 autocast. Off by default; fusions that read the saved input
/// decline an op with it on.
class QuantizedInputCache {
 public:
  bool caches_quantized_input() const { return on_; }
  void set_cache_quantized_input(bool on) { on_ = on; }

 protected:
  /// Saves x (in the compute dtype) for the backward: itself, or its E4M3 data and scale_inv.
  void save_input(OperationContext& ctx, const at::Tensor& x) const;
  /// What save_input kept, in ctx.compute_dtype.
  static at::Tensor saved_input(const OperationContext& ctx);

 private:
  bool on_ = false;
};

/// y = act(x), computed in the input's dtype (autocast's when on).
class ElementwiseActivation : public BasicOperation, public QuantizedInputCache {
 public:
  FUSIBLE_CLONEABLE_OP
  int64_t plan_settings() const override { return caches_quantized_input(); }
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
  /// Whether the backward reads the output (ReLU) rather than the input (a cached quantized input
  /// is always the input).
  bool saves_output() const { return kind_ == "relu" && !caches_quantized_input(); }
  /// Whether the forward may hand act(x) to the next op deferred (want_output_act): its backward
  /// must not need the output.
  bool defers(const OperationContext& ctx) const { return ctx.want_output_act && !saves_output(); }
  /// The deferred output of act(x): puts it in ctx.output_act and returns its stand-in (the
  /// forward's context filled by the caller, with x).
  at::Tensor defer_output(OperationContext& ctx, const at::Tensor& x) const;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::string kind_;
};

/// The GLU family's input layout: x's last dim holds [a | b] halves, or with te.ops'
/// glu_interleave_size = k > 0, alternating blocks of k columns [a_1..a_k, b_1..b_k, a_k+1..].
class GluLayout {
 public:
  explicit GluLayout(int64_t interleave_size = 0);
  int64_t interleave_size() const { return k_; }
  /// x (last dim even, and a multiple of 2k when interleaved) as [a | b] halves.
  at::Tensor to_halves(const char* op, const at::Tensor& x) const;
  /// The inverse, for the gradient of x.
  at::Tensor from_halves(const at::Tensor& dx) const;

 private:
  int64_t k_;
};

/// x = [a, b] on the last dim; y = act(a) * b (the first half is gated).
class GatedActivation : public BasicOperation, public QuantizedInputCache {
 public:
  FUSIBLE_CLONEABLE_OP
  int64_t plan_settings() const override { return caches_quantized_input(); }
  GatedActivation(std::string type_name, std::string kind, int64_t interleave_size = 0)
      : BasicOperation(std::move(type_name)), kind_(std::move(kind)), layout_(interleave_size) {}
  /// Kernel kind: glu, geglu, qgeglu, reglu, sreglu or swiglu.
  const std::string& kind() const { return kind_; }
  int64_t glu_interleave_size() const { return layout_.interleave_size(); }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 private:
  std::string kind_;
  GluLayout layout_;
};

#define FUSIBLE_ACTIVATION_CLASS(Name, Base, kind) \
  class Name : public Base {                       \
   public:                                         \
    FUSIBLE_CLONEABLE_OP                           \
    Name() : Base(#Name, kind) {}                  \
  };
#define FUSIBLE_GATED_CLASS(Name, kind)                                                           \
  class Name : public GatedActivation {                                                           \
   public:                                                                                        \
    FUSIBLE_CLONEABLE_OP                                                                          \
    explicit Name(int64_t interleave_size = 0) : GatedActivation(#Name, kind, interleave_size) {} \
  };

FUSIBLE_ACTIVATION_CLASS(GELU, ElementwiseActivation, "gelu")
FUSIBLE_ACTIVATION_CLASS(QGELU, ElementwiseActivation, "qgelu")
FUSIBLE_ACTIVATION_CLASS(ReLU, ElementwiseActivation, "relu")
FUSIBLE_ACTIVATION_CLASS(SReLU, ElementwiseActivation, "srelu")
FUSIBLE_ACTIVATION_CLASS(SiLU, ElementwiseActivation, "silu")
FUSIBLE_GATED_CLASS(GLU, "glu")
FUSIBLE_GATED_CLASS(GEGLU, "geglu")
FUSIBLE_GATED_CLASS(QGEGLU, "qgeglu")
FUSIBLE_GATED_CLASS(ReGLU, "reglu")
FUSIBLE_GATED_CLASS(SReGLU, "sreglu")
FUSIBLE_GATED_CLASS(SwiGLU, "swiglu")
#undef FUSIBLE_ACTIVATION_CLASS
#undef FUSIBLE_GATED_CLASS

/// A GLU whose gate has parameters (ClampedSwiGLU, SiTUGLU): the kernels are the subclass's.
class ParamGatedActivation : public BasicOperation, public QuantizedInputCache {
 public:
  ParamGatedActivation(std::string type_name, int64_t interleave_size)
      : BasicOperation(std::move(type_name)), layout_(interleave_size) {}
  int64_t plan_settings() const override { return caches_quantized_input(); }
  int64_t glu_interleave_size() const { return layout_.interleave_size(); }
  at::Tensor op_forward(OperationContext& ctx, const at::Tensor& x,
                        const ForwardArgs& args) override;
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(OperationContext& ctx,
                                                             const at::Tensor& dy) override;

 protected:
  /// On [a | b] halves in the compute dtype.
  virtual at::Tensor gate_fwd(const at::Tensor& x) const = 0;
  virtual at::Tensor gate_bwd(const at::Tensor& dy, const at::Tensor& x) const = 0;

 private:
  GluLayout layout_;
};

/// GPT-OSS SwiGLU: a = min(a, limit), b = clamp(b, -limit, limit),
/// y = a * sigmoid(alpha * a) * (b + offset) (te.ops' glu_linear_offset).
class ClampedSwiGLU : public ParamGatedActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ClampedSwiGLU(double limit = 7.0, double alpha = 1.702, double offset = 1.0,
                         int64_t interleave_size = 0);
  double limit() const { return limit_; }
  double alpha() const { return alpha_; }
  double glu_linear_offset() const { return offset_; }

 protected:
  at::Tensor gate_fwd(const at::Tensor& x) const override;
  at::Tensor gate_bwd(const at::Tensor& dy, const at::Tensor& x) const override;

 private:
  double limit_, alpha_, offset_;
};

/// SiTU GLU: y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2).
class SiTUGLU : public ParamGatedActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit SiTUGLU(double beta1 = 4.0, double beta2 = 25.0, int64_t interleave_size = 0);
  double beta1() const { return beta1_; }
  double beta2() const { return beta2_; }

 protected:
  at::Tensor gate_fwd(const at::Tensor& x) const override;
  at::Tensor gate_bwd(const at::Tensor& dy, const at::Tensor& x) const override;

 private:
  double beta1_, beta2_;
};

/// y = scales[..., None] * f(x) for an activation f; scales (extra input 0) has x's shape without
/// the last dim; the backward gives dscales = sum over the last dim of dy * f(x).
class RowScaledActivation : public BasicOperation {
 public:
  RowScaledActivation(std::string type_name, bool gated, int64_t interleave_size)
      : BasicOperation(std::move(type_name), /*num_extra_inputs=*/1),
        gated_(gated),
        layout_(interleave_size) {}
  int64_t glu_interleave_size() const { return layout_.interleave_size(); }
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override;
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override;

 protected:
  /// x in the compute dtype ([a | b] halves for a GLU).
  virtual at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const = 0;
  /// -> (dx, dscales).
  virtual std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& scales) const = 0;

 private:
  bool gated_;
  GluLayout layout_;
};

/// y = scales[..., None] * swiglu(x).
class ScaledSwiGLU : public RowScaledActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ScaledSwiGLU(int64_t interleave_size = 0)
      : RowScaledActivation("ScaledSwiGLU", true, interleave_size) {}

 protected:
  at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const override;
  std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& scales) const override;
};

/// y = scales[..., None] * situglu(x).
class ScaledSiTUGLU : public RowScaledActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ScaledSiTUGLU(double beta1 = 4.0, double beta2 = 25.0, int64_t interleave_size = 0);
  double beta1() const { return beta1_; }
  double beta2() const { return beta2_; }

 protected:
  at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const override;
  std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& scales) const override;

 private:
  double beta1_, beta2_;
};

/// y = scales[..., None] * clamped_swiglu(x) (te.ops' ScaledClampedQGeGLU).
class ScaledClampedQGeGLU : public RowScaledActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ScaledClampedQGeGLU(double limit = 7.0, double alpha = 1.702, double offset = 1.0,
                               int64_t interleave_size = 0);
  double limit() const { return limit_; }
  double alpha() const { return alpha_; }
  double glu_linear_offset() const { return offset_; }

 protected:
  at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const override;
  std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& scales) const override;

 private:
  double limit_, alpha_, offset_;
};

/// y = scales[..., None] * max(x, 0)^2 (elementwise: the output keeps x's shape).
class ScaledSReLU : public RowScaledActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  ScaledSReLU() : RowScaledActivation("ScaledSReLU", false, 0) {}

 protected:
  at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const override;
  std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& scales) const override;
};

/// y = scales[..., None] * (c tanh(max(x, 0) / c))^2, c = tanh_clamp_scale > 0: a squared ReLU
/// that saturates at c^2 (te.ops' ScaledTanhSReLU).
class ScaledTanhSReLU : public RowScaledActivation {
 public:
  FUSIBLE_CLONEABLE_OP
  explicit ScaledTanhSReLU(double tanh_clamp_scale);
  double tanh_clamp_scale() const { return c_; }

 protected:
  at::Tensor scaled_fwd(const at::Tensor& x, const at::Tensor& scales) const override;
  std::tuple<at::Tensor, at::Tensor> scaled_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& scales) const override;

 private:
  double c_;
};

}  // namespace fusible::ops

// The one schema table of torch.ops.fusible: every kernel-level op, with one comment each.
// Implementations register beside their code, one TORCH_LIBRARY_IMPL block per dispatch key.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

// The names of the schemas below, gathered as they are defined: the Autograd registration takes
// them from here (one list: the definitions themselves).
std::vector<std::string>& defined_names() {
  static std::vector<std::string> names;
  return names;
}

void define(torch::Library& m, const char* schema, const std::vector<at::Tag>& tags = {}) {
  m.def(schema, tags);
  const std::string s(schema);
  defined_names().push_back(s.substr(0, s.find('(')));
}

}  // namespace

TORCH_LIBRARY(fusible, m) {
  // y = x + bias, bias broadcast over the last dim. x: [..., N], bias: [N].
  define(m, "bias_fwd(Tensor x, Tensor bias) -> Tensor");
  // Bias gradient: dy summed over every leading dim. dy: [..., N] -> [N].
  define(m, "bias_bwd(Tensor dy) -> Tensor");

  // y = x W^T (+ bias). x: [..., K], weight: [N, K], bias: [N] -> [..., N].
  define(m, "linear_fwd(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // dx = alpha * dy W. dy: [..., N], weight: [N, K] -> [..., K].
  define(m, "linear_dgrad(Tensor dy, Tensor weight, float alpha=1.0) -> Tensor");
  // dW = alpha * dy^T x over all leading dims. dy: [..., N], x: [..., K] -> [N, K].
  define(m, "linear_wgrad(Tensor dy, Tensor x, float alpha=1.0) -> Tensor");

  // GEMMs with fused epilogues (ForwardLinear*/BackwardLinear* fused ops):
  // (y, pre) with pre = x W^T + bias and y = act(pre); act in {gelu (tanh), relu}.
  define(m,
         "linear_bias_act_fwd(Tensor x, Tensor weight, Tensor? bias, str act) -> (Tensor, Tensor)");
  // relu(x W^T + bias) (ReLU's backward reads its output, so no pre-activation is kept).
  define(m, "linear_bias_act(Tensor x, Tensor weight, Tensor? bias, str act) -> Tensor");
  // alpha * x W^T + bias + other, into a new tensor (other: the output's shape and dtype).
  define(m,
         "linear_add(Tensor x, Tensor weight, Tensor? bias, Tensor other, float alpha) -> Tensor");
  // out += alpha * x W^T + bias, in place.
  define(m,
         "linear_add_(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, float alpha) -> ()");
  // alpha * dy W + other, into a new tensor (other: dx's shape and dtype).
  define(m, "linear_dgrad_add(Tensor dy, Tensor weight, Tensor other, float alpha) -> Tensor");
  // The dgrad of the linear after a bias + activation, with the activation's backward and the
  // bias gradient in its epilogue: dz = dy W, -> (dpre = act'(pre) * dz, dbias = sum of dpre).
  define(
      m,
      "linear_dgrad_act_bias(Tensor dy, Tensor weight, Tensor pre, str act) -> (Tensor, Tensor)");
  // Bias + activation backward: -> (dpre = act'(pre) * dy, dbias = sum of dpre).
  define(m, "bias_act_bwd(Tensor dy, Tensor pre, str act) -> (Tensor, Tensor)");
  // bias_act_bwd in place: dy becomes dpre (pre's shape and dtype); -> dbias.
  define(m, "bias_act_bwd_(Tensor(a!) dy, Tensor pre, str act) -> Tensor");
  // RMSNorm backward plus the residual's gradient: -> (rmsnorm dx + dextra, dweight).
  define(
      m,
      "rmsnorm_bwd_add(Tensor dy, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma, "
      "Tensor dextra) -> (Tensor, Tensor)");
  // LayerNorm backward plus the residual's gradient: -> (layernorm dx + dextra, dweight, dbias).
  define(m,
         "layernorm_bwd_add(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight, bool "
         "zero_centered_gamma, Tensor dextra) -> (Tensor, Tensor, Tensor)");

  // LayerNorm over the trailing weight.shape dims -> (y, mean, rstd), stats over x's leading dims,
  // stats in fp32/fp64.
  define(
      m,
      "layernorm_fwd(Tensor x, Tensor weight, Tensor bias, float eps, bool zero_centered_gamma) -> "
      "(Tensor, Tensor, Tensor)");
  // LayerNorm backward from the saved stats -> (dx, dweight, dbias).
  define(m,
         "layernorm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight, bool "
         "zero_centered_gamma) -> (Tensor, Tensor, Tensor)");
  // RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w -> (y, rstd over x's leading dims).
  define(m,
         "rmsnorm_fwd(Tensor x, Tensor weight, float eps, bool zero_centered_gamma) -> (Tensor, "
         "Tensor)");
  // RMSNorm backward -> (dx, dweight).
  define(
      m,
      "rmsnorm_bwd(Tensor dy, Tensor x, Tensor rstd, Tensor weight, bool zero_centered_gamma) -> "
      "(Tensor, Tensor)");
  // L2 normalization over the last dim: y = x * rsqrt(sum(x^2) + eps) -> (y, rstd [...]).
  define(m, "l2norm_fwd(Tensor x, float eps) -> (Tensor, Tensor)");
  // L2 normalization backward -> dx.
  define(m, "l2norm_bwd(Tensor dy, Tensor x, Tensor rstd) -> Tensor");

  // Elementwise activation; kind in {gelu (tanh), qgelu, relu, srelu, silu}.
  define(m, "activation_fwd(Tensor x, str kind) -> Tensor");
  // Its backward: dx = dy * act'(x).
  define(m, "activation_bwd(Tensor dy, Tensor x, str kind) -> Tensor");
  // Gated activation: x = [a, b] on the last dim, y = act(a) * b; kind in {glu, geglu, qgeglu,
  // reglu, sreglu, swiglu}. x: [..., 2H] -> [..., H].
  define(m, "glu_fwd(Tensor x, str kind) -> Tensor");
  // Its backward -> dx [..., 2H].
  define(m, "glu_bwd(Tensor dy, Tensor x, str kind) -> Tensor");
  // ClampedSwiGLU: a = min(a, limit), b = clamp(b, -limit, limit),
  // y = a * sigmoid(alpha * a) * (b + offset).
  define(m, "clamped_swiglu_fwd(Tensor x, float limit, float alpha, float offset=1.0) -> Tensor");
  // Its backward -> dx.
  define(m,
         "clamped_swiglu_bwd(Tensor dy, Tensor x, float limit, float alpha, float offset=1.0) -> "
         "Tensor");
  // SiTUGLU: y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) (beta1, beta2 > 0).
  define(m, "situglu_fwd(Tensor x, float beta1=4.0, float beta2=25.0) -> Tensor");
  // Its backward -> dx.
  define(m, "situglu_bwd(Tensor dy, Tensor x, float beta1=4.0, float beta2=25.0) -> Tensor");
  // ScaledSwiGLU: y = scales[..., None] * swiglu(x). scales: x's shape without the last dim.
  define(m, "scaled_swiglu_fwd(Tensor x, Tensor scales) -> Tensor");
  // Its backward -> (dx, dscales).
  define(m, "scaled_swiglu_bwd(Tensor dy, Tensor x, Tensor scales) -> (Tensor, Tensor)");
  // scaled_swiglu_bwd plus the forward's output y = scales * swiglu(x), recomputed in the same
  // pass (a fused op that keeps x need not keep y) -> (dx, dscales, y).
  define(m,
         "scaled_swiglu_bwd_fwd(Tensor dy, Tensor x, Tensor scales) -> (Tensor, Tensor, Tensor)");
  // ScaledSiTUGLU: y = scales[..., None] * situglu(x); backward -> (dx, dscales).
  define(
      m,
      "scaled_situglu_fwd(Tensor x, Tensor scales, float beta1=4.0, float beta2=25.0) -> Tensor");
  define(
      m,
      "scaled_situglu_bwd(Tensor dy, Tensor x, Tensor scales, float beta1=4.0, float beta2=25.0) "
      "-> (Tensor, Tensor)");
  // ScaledClampedQGeGLU: y = scales[..., None] * clamped_swiglu(x); backward -> (dx, dscales).
  define(m,
         "scaled_clamped_swiglu_fwd(Tensor x, Tensor scales, float limit=7.0, float alpha=1.702, "
         "float offset=1.0) -> Tensor");
  define(m,
         "scaled_clamped_swiglu_bwd(Tensor dy, Tensor x, Tensor scales, float limit=7.0, "
         "float alpha=1.702, float offset=1.0) -> (Tensor, Tensor)");

  // y = scale * x (also ConstantScale's backward).
  define(m, "scale_fwd(Tensor x, float scale) -> Tensor");
  // y = x + other, same shapes, in x's dtype.
  define(m, "add_fwd(Tensor x, Tensor other) -> Tensor");
  // self += other in place (AddExtraInput(in_place=True)).
  define(m, "add_(Tensor(a!) self, Tensor other) -> ()");
  // Dropout: -> (y, keep mask as bits [uint8, ceil(numel / 8)]: element e is bit e % 8 of byte
  // e / 8); y = x * keep / (1 - p).
  define(m, "dropout_fwd(Tensor x, float p) -> (Tensor, Tensor)",
         {at::Tag::nondeterministic_seeded});
  // Dropout backward from the saved mask.
  define(m, "dropout_bwd(Tensor dy, Tensor mask, float p) -> Tensor");

  // FP8 (current scaling): x cast to FP8 format 'e4m3' or 'e5m2' with scale = fp8_max / amax(x) /
  // 2^margin, and back to x's dtype: the values an FP8 GEMM computes with (CPU emulation).
  define(m, "fp8_quantize_dequantize(Tensor x, str format, float margin=0.0) -> Tensor");
  // FP8 (delayed scaling): x cast with `scale` and back; then amax(x) enters amax_history
  // (newest first) and scale becomes fp8_max / (its max, or newest, amax) / 2^margin.
  define(m,
         "fp8_quantize_dequantize_delayed(Tensor x, str format, Tensor(a!) amax_history, "
         "Tensor(b!) scale, float margin, str amax_compute_algo) -> Tensor");
  // FP8 (block scaling): x as [rows, last dim] in 1x128 (block_dim 1) or 128x128 (block_dim 2)
  // blocks, each cast with its own scale (a power of two with power_2_scale) and back.
  define(
      m,
      "fp8_quantize_dequantize_block(Tensor x, str format, int block_dim, bool power_2_scale=True)"
      " -> Tensor");
  // FP8 data for a GEMM (current scaling): -> (data in x's shape, data_t [K, M] for x as [M, K]
  // rows (empty unless transpose), scale_inv [1] fp32); data = fp8(x * scale).
  define(
      m,
      "fp8_cast(Tensor x, str format, float margin=0.0, bool transpose=False) -> (Tensor, Tensor, "
      "Tensor)");
  // The same with delayed scaling's scale, then its history and scale updated.
  define(m,
         "fp8_cast_delayed(Tensor x, str format, Tensor(a!) amax_history, Tensor(b!) scale, "
         "float margin, str amax_compute_algo, bool transpose=False) -> (Tensor, Tensor, Tensor)");
  // d = act(alpha * (a * a_scale_inv) @ (b * b_scale_inv)^T + bias + other) in out_dtype: a
  // [..., K] and b [N, K] FP8 (not both e5m2), fp32 accumulation (fast_accum: cuBLASLt's faster,
  // less exact one). act 'none', 'gelu' (tanh) or 'relu' (then no other). -> (d, the
  // pre-activation when save_pre, else empty).
  define(
      m,
      "fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, "
      "Tensor? bias=None, Tensor? other=None, float alpha=1.0, str act='none', bool "
      "save_pre=False, "
      "bool fast_accum=False, int a_block=0, int b_block=0) -> (Tensor, Tensor)");
  // Block-scaled FP8 cast (Float8BlockScaling) as cuBLASLt's block-scaled GEMMs read it: x as
  // [M, K] in 1x128 (block_dim 1) or 128x128 (2) blocks with power-of-two scales -> (data,
  // scale_inv [ceil(K/128), M rounded up to 4] or [ceil(M/128), ceil(K/128) rounded up to 4],
  // data_t [K, M] (columnwise: x^T cast the same way), its scale_inv); parts not asked for [0].
  define(m,
         "fp8_cast_block(Tensor x, str format, int block_dim, bool rowwise=True, bool "
         "columnwise=False) -> (Tensor, Tensor, Tensor, Tensor)");

  // GroupedLinear's grouped GEMMs: the rows of x [T, K] split into G consecutive groups by
  // split_sizes (int32 / int64 [G] on x's device; non-negative, summing to T: checked on the host
  // on CPU, by a device-side assert on CUDA, where the split never reaches the host).
  // y_g = x_g W_g^T + b_g (times the row's scale when scales [T] is given). weight: [G, N, K],
  // bias: [G, N] -> [T, N].
  define(
      m,
      "grouped_linear_fwd(Tensor x, Tensor weight, Tensor split_sizes, Tensor? bias=None, Tensor? "
      "scales=None) -> Tensor");
  // dx_g = dy_g W_g. dy: [T, N], weight: [G, N, K] -> [T, K].
  define(m, "grouped_linear_dgrad(Tensor dy, Tensor weight, Tensor split_sizes) -> Tensor");
  // dW_g = dy_g^T x_g (zeros for an empty group). dy: [T, N], x: [T, K] -> [G, N, K].
  define(m, "grouped_linear_wgrad(Tensor dy, Tensor x, Tensor split_sizes) -> Tensor");
  // -> (dbias [G, N]: dy summed over each group's rows, times the scales when given; dscales [T]:
  // dy_r . b_g in the scales' dtype when bias is given, else [0]).
  define(
      m,
      "grouped_bias_bwd(Tensor dy, Tensor split_sizes, Tensor? scales=None, Tensor? bias=None) -> "
      "(Tensor, Tensor)");
}

// Autograd: no op here has a derivative formula (the fuser's one autograd node differentiates whole
// calls). Registering the not-implemented kernel makes a backward through a direct call raise an
// error naming the op, instead of PyTorch's "autograd kernel was not registered" warning.
TORCH_LIBRARY_IMPL(fusible, Autograd, m) {
  // (Registered after the definitions above: static initialization runs in this file's order.)
  for (const auto& name : defined_names()) {
    m.impl(name.c_str(), torch::autograd::autogradNotImplementedFallback());
  }
}

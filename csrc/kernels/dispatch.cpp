// Typed dispatcher handles behind kernels/dispatch.h; each schema is looked up once.
#include "kernels/dispatch.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace fusible::kernels {
namespace {

using T = at::Tensor;
using CT = const at::Tensor&;
using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using T4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

#define FUSIBLE_OP(name, sig) static const auto op = handle<sig>("fusible::" name)

}  // namespace

T bias_fwd(CT x, CT bias) {
  FUSIBLE_OP("bias_fwd", T(CT, CT));
  return op.call(x, bias);
}
T bias_bwd(CT dy) {
  FUSIBLE_OP("bias_bwd", T(CT));
  return op.call(dy);
}
T linear_fwd(CT x, CT weight, const std::optional<at::Tensor>& bias) {
  FUSIBLE_OP("linear_fwd", T(CT, CT, const std::optional<at::Tensor>&));
  return op.call(x, weight, bias);
}
T linear_dgrad(CT dy, CT weight, double alpha) {
  FUSIBLE_OP("linear_dgrad", T(CT, CT, double));
  return op.call(dy, weight, alpha);
}
T linear_wgrad(CT dy, CT x, double alpha) {
  FUSIBLE_OP("linear_wgrad", T(CT, CT, double));
  return op.call(dy, x, alpha);
}
T2 linear_bias_act_fwd(CT x, CT weight, const std::optional<at::Tensor>& bias,
                       const std::string& act) {
  FUSIBLE_OP("linear_bias_act_fwd", T2(CT, CT, const std::optional<at::Tensor>&, c10::string_view));
  return op.call(x, weight, bias, act);
}
T linear_bias_act(CT x, CT weight, const std::optional<at::Tensor>& bias, const std::string& act) {
  FUSIBLE_OP("linear_bias_act", T(CT, CT, const std::optional<at::Tensor>&, c10::string_view));
  return op.call(x, weight, bias, act);
}
T linear_add(CT x, CT weight, const std::optional<at::Tensor>& bias, CT other, double alpha) {
  FUSIBLE_OP("linear_add", T(CT, CT, const std::optional<at::Tensor>&, CT, double));
  return op.call(x, weight, bias, other, alpha);
}
void linear_add_(CT out, CT x, CT weight, const std::optional<at::Tensor>& bias, double alpha) {
  FUSIBLE_OP("linear_add_", void(CT, CT, CT, const std::optional<at::Tensor>&, double));
  op.call(out, x, weight, bias, alpha);
}
T linear_dgrad_add(CT dy, CT weight, CT other, double alpha) {
  FUSIBLE_OP("linear_dgrad_add", T(CT, CT, CT, double));
  return op.call(dy, weight, other, alpha);
}
T2 linear_dgrad_act_bias(CT dy, CT weight, CT pre, const std::string& act) {
  FUSIBLE_OP("linear_dgrad_act_bias", T2(CT, CT, CT, c10::string_view));
  return op.call(dy, weight, pre, act);
}
T bias_act_bwd_(CT dy, CT pre, const std::string& act) {
  FUSIBLE_OP("bias_act_bwd_", T(CT, CT, c10::string_view));
  return op.call(dy, pre, act);
}
T2 bias_act_bwd(CT dy, CT pre, const std::string& act) {
  FUSIBLE_OP("bias_act_bwd", T2(CT, CT, c10::string_view));
  return op.call(dy, pre, act);
}
T2 rmsnorm_bwd_add(CT dy, CT x, CT rstd, CT weight, bool zero_centered_gamma, CT dextra) {
  FUSIBLE_OP("rmsnorm_bwd_add", T2(CT, CT, CT, CT, bool, CT));
  return op.call(dy, x, rstd, weight, zero_centered_gamma, dextra);
}
T3 layernorm_bwd_add(CT dy, CT x, CT mean, CT rstd, CT weight, bool zcg, CT dextra) {
  FUSIBLE_OP("layernorm_bwd_add", T3(CT, CT, CT, CT, CT, bool, CT));
  return op.call(dy, x, mean, rstd, weight, zcg, dextra);
}
T3 layernorm_fwd(CT x, CT weight, CT bias, double eps, bool zcg) {
  FUSIBLE_OP("layernorm_fwd", T3(CT, CT, CT, double, bool));
  return op.call(x, weight, bias, eps, zcg);
}
T3 layernorm_bwd(CT dy, CT x, CT mean, CT rstd, CT weight, bool zcg) {
  FUSIBLE_OP("layernorm_bwd", T3(CT, CT, CT, CT, CT, bool));
  return op.call(dy, x, mean, rstd, weight, zcg);
}
T2 rmsnorm_fwd(CT x, CT weight, double eps, bool zcg) {
  FUSIBLE_OP("rmsnorm_fwd", T2(CT, CT, double, bool));
  return op.call(x, weight, eps, zcg);
}
T2 rmsnorm_bwd(CT dy, CT x, CT rstd, CT weight, bool zcg) {
  FUSIBLE_OP("rmsnorm_bwd", T2(CT, CT, CT, CT, bool));
  return op.call(dy, x, rstd, weight, zcg);
}
T2 l2norm_fwd(CT x, double eps) {
  FUSIBLE_OP("l2norm_fwd", T2(CT, double));
  return op.call(x, eps);
}
T l2norm_bwd(CT dy, CT x, CT rstd) {
  FUSIBLE_OP("l2norm_bwd", T(CT, CT, CT));
  return op.call(dy, x, rstd);
}
T activation_fwd(CT x, const std::string& kind) {
  FUSIBLE_OP("activation_fwd", T(CT, c10::string_view));
  return op.call(x, kind);
}
T activation_bwd(CT dy, CT x, const std::string& kind) {
  FUSIBLE_OP("activation_bwd", T(CT, CT, c10::string_view));
  return op.call(dy, x, kind);
}
T glu_fwd(CT x, const std::string& kind) {
  FUSIBLE_OP("glu_fwd", T(CT, c10::string_view));
  return op.call(x, kind);
}
T glu_bwd(CT dy, CT x, const std::string& kind) {
  FUSIBLE_OP("glu_bwd", T(CT, CT, c10::string_view));
  return op.call(dy, x, kind);
}
T clamped_swiglu_fwd(CT x, double limit, double alpha, double offset) {
  FUSIBLE_OP("clamped_swiglu_fwd", T(CT, double, double, double));
  return op.call(x, limit, alpha, offset);
}
T clamped_swiglu_bwd(CT dy, CT x, double limit, double alpha, double offset) {
  FUSIBLE_OP("clamped_swiglu_bwd", T(CT, CT, double, double, double));
  return op.call(dy, x, limit, alpha, offset);
}
T situglu_fwd(CT x, double beta1, double beta2) {
  FUSIBLE_OP("situglu_fwd", T(CT, double, double));
  return op.call(x, beta1, beta2);
}
T situglu_bwd(CT dy, CT x, double beta1, double beta2) {
  FUSIBLE_OP("situglu_bwd", T(CT, CT, double, double));
  return op.call(dy, x, beta1, beta2);
}
T scaled_swiglu_fwd(CT x, CT scales) {
  FUSIBLE_OP("scaled_swiglu_fwd", T(CT, CT));
  return op.call(x, scales);
}
T3 scaled_swiglu_bwd_fwd(CT dy, CT x, CT scales) {
  FUSIBLE_OP("scaled_swiglu_bwd_fwd", T3(CT, CT, CT));
  return op.call(dy, x, scales);
}
T2 scaled_swiglu_bwd(CT dy, CT x, CT scales) {
  FUSIBLE_OP("scaled_swiglu_bwd", T2(CT, CT, CT));
  return op.call(dy, x, scales);
}
T scaled_situglu_fwd(CT x, CT scales, double beta1, double beta2) {
  FUSIBLE_OP("scaled_situglu_fwd", T(CT, CT, double, double));
  return op.call(x, scales, beta1, beta2);
}
T2 scaled_situglu_bwd(CT dy, CT x, CT scales, double beta1, double beta2) {
  FUSIBLE_OP("scaled_situglu_bwd", T2(CT, CT, CT, double, double));
  return op.call(dy, x, scales, beta1, beta2);
}
T scaled_clamped_swiglu_fwd(CT x, CT scales, double limit, double alpha, double offset) {
  FUSIBLE_OP("scaled_clamped_swiglu_fwd", T(CT, CT, double, double, double));
  return op.call(x, scales, limit, alpha, offset);
}
T2 scaled_clamped_swiglu_bwd(CT dy, CT x, CT scales, double limit, double alpha, double offset) {
  FUSIBLE_OP("scaled_clamped_swiglu_bwd", T2(CT, CT, CT, double, double, double));
  return op.call(dy, x, scales, limit, alpha, offset);
}
T scale_fwd(CT x, double scale) {
  FUSIBLE_OP("scale_fwd", T(CT, double));
  return op.call(x, scale);
}
T add_fwd(CT x, CT other) {
  FUSIBLE_OP("add_fwd", T(CT, CT));
  return op.call(x, other);
}
void add_(CT self, CT other) {
  FUSIBLE_OP("add_", void(CT, CT));
  op.call(self, other);
}
T2 dropout_fwd(CT x, double p) {
  FUSIBLE_OP("dropout_fwd", T2(CT, double));
  return op.call(x, p);
}
T dropout_bwd(CT dy, CT mask, double p) {
  FUSIBLE_OP("dropout_bwd", T(CT, CT, double));
  return op.call(dy, mask, p);
}

T fp8_quantize_dequantize(CT x, const std::string& format, double margin) {
  FUSIBLE_OP("fp8_quantize_dequantize", T(CT, c10::string_view, double));
  return op.call(x, format, margin);
}

T fp8_quantize_dequantize_delayed(CT x, const std::string& format, CT amax_history, CT scale,
                                  double margin, const std::string& amax_compute_algo) {
  FUSIBLE_OP("fp8_quantize_dequantize_delayed",
             T(CT, c10::string_view, CT, CT, double, c10::string_view));
  return op.call(x, format, amax_history, scale, margin, amax_compute_algo);
}

T fp8_quantize_dequantize_block(CT x, const std::string& format, int64_t block_dim,
                                bool power_2_scale) {
  FUSIBLE_OP("fp8_quantize_dequantize_block", T(CT, c10::string_view, int64_t, bool));
  return op.call(x, format, block_dim, power_2_scale);
}

T3 fp8_cast(CT x, const std::string& format, double margin, bool transpose) {
  FUSIBLE_OP("fp8_cast", T3(CT, c10::string_view, double, bool));
  return op.call(x, format, margin, transpose);
}

T3 fp8_cast_delayed(CT x, const std::string& format, CT amax_history, CT scale, double margin,
                    const std::string& amax_compute_algo, bool transpose) {
  FUSIBLE_OP("fp8_cast_delayed", T3(CT, c10::string_view, CT, CT, double, c10::string_view, bool));
  return op.call(x, format, amax_history, scale, margin, amax_compute_algo, transpose);
}

T2 fp8_gemm(CT a, CT a_scale_inv, CT b, CT b_scale_inv, at::ScalarType out_dtype,
            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& other,
            double alpha, const std::string& act, bool save_pre, bool fast_accum, int64_t a_block,
            int64_t b_block) {
  FUSIBLE_OP("fp8_gemm", T2(CT, CT, CT, CT, at::ScalarType, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, double, c10::string_view, bool, bool,
                            int64_t, int64_t));
  return op.call(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, alpha, act, save_pre,
                 fast_accum, a_block, b_block);
}

T4 fp8_cast_block(CT x, const std::string& format, int64_t block_dim, bool rowwise,
                  bool columnwise) {
  FUSIBLE_OP("fp8_cast_block", T4(CT, c10::string_view, int64_t, bool, bool));
  return op.call(x, format, block_dim, rowwise, columnwise);
}

using OT = const std::optional<at::Tensor>&;

T grouped_linear_fwd(CT x, CT weight, CT split_sizes, OT bias, OT scales) {
  FUSIBLE_OP("grouped_linear_fwd", T(CT, CT, CT, OT, OT));
  return op.call(x, weight, split_sizes, bias, scales);
}
T grouped_linear_dgrad(CT dy, CT weight, CT split_sizes) {
  FUSIBLE_OP("grouped_linear_dgrad", T(CT, CT, CT));
  return op.call(dy, weight, split_sizes);
}
T grouped_linear_wgrad(CT dy, CT x, CT split_sizes) {
  FUSIBLE_OP("grouped_linear_wgrad", T(CT, CT, CT));
  return op.call(dy, x, split_sizes);
}
T2 grouped_bias_bwd(CT dy, CT split_sizes, OT scales, OT bias) {
  FUSIBLE_OP("grouped_bias_bwd", T2(CT, CT, OT, OT));
  return op.call(dy, split_sizes, scales, bias);
}

}  // namespace fusible::kernels

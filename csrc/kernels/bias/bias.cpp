// bias_fwd / bias_bwd: argument checks, the CPU reference (ATen) and the Meta (shape-only) version;
// bias_act_bwd(_): the reference (CPU, CUDA fallback, Meta) through the dispatched activation and
// bias ops, in the accumulation dtype.
#include "kernels/bias/bias.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <string>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/dispatch.h"
#include "kernels/linear/linear.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {

void check_bias_fwd_args(const at::Tensor& x, const at::Tensor& bias) {
  FUSIBLE_CHECK_FLOATING("bias_fwd", "x", x);
  FUSIBLE_CHECK_MIN_DIM("bias_fwd", "x", x, 1);
  FUSIBLE_CHECK_DIM("bias_fwd", "bias", bias, 1);
  FUSIBLE_CHECK_SAME_DEVICE("bias_fwd", "x", x, "bias", bias);
  FUSIBLE_CHECK_SAME_DTYPE("bias_fwd", "x", x, "bias", bias);
  FUSIBLE_CHECK_SIZE("bias_fwd", "x.size(-1)", x.size(-1), bias.size(0));
}

void check_bias_bwd_args(const at::Tensor& dy) {
  FUSIBLE_CHECK_FLOATING("bias_bwd", "dy", dy);
  FUSIBLE_CHECK_MIN_DIM("bias_bwd", "dy", dy, 1);
}

namespace {

at::Tensor bias_fwd_cpu(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_fwd_args(x, bias);
  return x.contiguous() + bias;
}

at::Tensor bias_bwd_cpu(const at::Tensor& dy) {
  check_bias_bwd_args(dy);
  // Accumulate in fp32 (fp64 stays fp64) like the CUDA kernel, then round once.
  const auto acc = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return dy.reshape({-1, dy.size(-1)}).sum(0, /*keepdim=*/false, acc).to(dy.scalar_type());
}

at::Tensor bias_fwd_meta(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_fwd_args(x, bias);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

at::Tensor bias_bwd_meta(const at::Tensor& dy) {
  check_bias_bwd_args(dy);
  return at::empty({dy.size(-1)}, dy.options());
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_ref(const at::Tensor& dy, const at::Tensor& pre,
                                                    c10::string_view act) {
  reference::check_epilogue_act("bias_act_bwd", act);
  FUSIBLE_CHECK_SAME_DTYPE("bias_act_bwd", "dy", dy, "pre", pre);
  // dbias sums the unrounded dpre, as the CUDA kernel does.
  const auto dpre = activation_bwd(upcast(dy), upcast(pre), std::string(act));
  return {dpre.to(dy.scalar_type()), bias_bwd(dpre).to(dy.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_amax_ref(const at::Tensor& dy,
                                                                     const at::Tensor& pre,
                                                                     c10::string_view act) {
  FUSIBLE_CHECK_SAME_DEVICE("bias_act_bwd_amax", "dy", dy, "pre", pre);
  auto [dpre, dbias] = bias_act_bwd_ref(dy, pre, act);
  return {dpre, dbias, reference::amax_of(dpre)};
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_amax__ref(const at::Tensor& dy,
                                                          const at::Tensor& pre,
                                                          c10::string_view act) {
  FUSIBLE_CHECK_SAME_DTYPE("bias_act_bwd_amax_", "dy", dy, "pre", pre);
  auto [dpre, dbias, amax] = bias_act_bwd_amax_ref(dy, pre, act);
  dy.copy_(dpre);
  return {dbias, amax};
}

at::Tensor bias_act_bwd__ref(const at::Tensor& dy, const at::Tensor& pre, c10::string_view act) {
  FUSIBLE_CHECK_SAME_DTYPE("bias_act_bwd_", "dy", dy, "pre", pre);
  auto [dpre, dbias] = bias_act_bwd_ref(dy, pre, act);
  dy.copy_(dpre);
  return dbias;
}

}  // namespace

// ---- Entry points for C++ callers (declared in bias.h).

at::Tensor bias_fwd(const at::Tensor& x, const at::Tensor& bias) {
  FUSIBLE_DISPATCH(bias_fwd, x, bias);
}
at::Tensor bias_bwd(const at::Tensor& dy) { FUSIBLE_DISPATCH(bias_bwd, dy); }
std::tuple<at::Tensor, at::Tensor> bias_act_bwd(const at::Tensor& dy, const at::Tensor& pre,
                                                const std::string& act) {
  FUSIBLE_DISPATCH(bias_act_bwd, dy, pre, act);
}
at::Tensor bias_act_bwd_(const at::Tensor& dy, const at::Tensor& pre, const std::string& act) {
  FUSIBLE_DISPATCH(bias_act_bwd_, dy, pre, act);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_amax(const at::Tensor& dy,
                                                                 const at::Tensor& pre,
                                                                 const std::string& act) {
  FUSIBLE_DISPATCH(bias_act_bwd_amax, dy, pre, act);
}
std::tuple<at::Tensor, at::Tensor> bias_act_bwd_amax_(const at::Tensor& dy, const at::Tensor& pre,
                                                      const std::string& act) {
  FUSIBLE_DISPATCH(bias_act_bwd_amax_, dy, pre, act);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // y = x + bias, bias broadcast over the last dim. x: [..., N], bias: [N].
  define(m, "bias_fwd(Tensor x, Tensor bias) -> Tensor");
  // Bias gradient: dy summed over every leading dim. dy: [..., N] -> [N].
  define(m, "bias_bwd(Tensor dy) -> Tensor");
  // Bias + activation backward: -> (dpre = act'(pre) * dy, dbias = sum of dpre).
  define(m, "bias_act_bwd(Tensor dy, Tensor pre, str act) -> (Tensor, Tensor)");
  // bias_act_bwd plus max |dpre| ([1] fp32) from the same pass: -> (dpre, dbias, amax), what an
  // FP8 cast of dpre needs (fp8_cast_with_amax) without reading dpre again.
  define(m, "bias_act_bwd_amax(Tensor dy, Tensor pre, str act) -> (Tensor, Tensor, Tensor)");
  // bias_act_bwd_amax in place: dy becomes dpre; -> (dbias, amax).
  define(m, "bias_act_bwd_amax_(Tensor(a!) dy, Tensor pre, str act) -> (Tensor, Tensor)");
  // bias_act_bwd in place: dy becomes dpre (pre's shape and dtype); -> dbias.
  define(m, "bias_act_bwd_(Tensor(a!) dy, Tensor pre, str act) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("bias_fwd", &bias_fwd_cpu);
  m.impl("bias_bwd", &bias_bwd_cpu);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) {
  m.impl("bias_fwd", &bias_fwd_meta);
  m.impl("bias_bwd", &bias_bwd_meta);
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("bias_act_bwd", &bias_act_bwd_ref);
  m.impl("bias_act_bwd_", &bias_act_bwd__ref);
  m.impl("bias_act_bwd_amax", &bias_act_bwd_amax_ref);
  m.impl("bias_act_bwd_amax_", &bias_act_bwd_amax__ref);
}

}  // namespace fusible::kernels

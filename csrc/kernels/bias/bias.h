// bias_fwd / bias_bwd: argument checks shared by the CPU, CUDA and Meta implementations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels {

/// Checks x [..., N] and bias [N]: same device and dtype, floating, N matching.
void check_bias_fwd_args(const at::Tensor& x, const at::Tensor& bias);
/// Checks dy [..., N]: floating, at least 1-D.
void check_bias_bwd_args(const at::Tensor& dy);

#ifdef FUSIBLE_WITH_CUDA
/// CUDA: dz <- dz * act'(pre) in place (both contiguous, one dtype and shape); returns dbias, the
/// sum of the new dz over its rows. One pass (the dgrad-then-activation path of
/// linear_dgrad_act_bias).
at::Tensor bias_act_bwd_in_place(const at::Tensor& dz, const at::Tensor& pre, c10::string_view act);
#endif

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// bias.cpp.
namespace fusible::kernels {

/// y = x + bias. x: [..., N], bias: [N] -> [..., N].
at::Tensor bias_fwd(const at::Tensor& x, const at::Tensor& bias);
/// dbias = dy summed over leading dims. dy: [..., N] -> [N].
at::Tensor bias_bwd(const at::Tensor& dy);
std::tuple<at::Tensor, at::Tensor> bias_act_bwd(const at::Tensor& dy, const at::Tensor& pre,
                                                const std::string& act);
/// -> (act'(pre) * dy, its sum over leading dims).
/// bias_act_bwd in place: dy becomes dpre; -> dbias.
at::Tensor bias_act_bwd_(const at::Tensor& dy, const at::Tensor& pre, const std::string& act);
/// bias_act_bwd -> (dpre, dbias, max |dpre| as [1] fp32) in one pass: for an FP8 cast of dpre.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_amax(const at::Tensor& dy,
                                                                 const at::Tensor& pre,
                                                                 const std::string& act);
/// bias_act_bwd_amax in place: dy becomes dpre; -> (dbias, max |dpre|).
std::tuple<at::Tensor, at::Tensor> bias_act_bwd_amax_(const at::Tensor& dy, const at::Tensor& pre,
                                                      const std::string& act);

}  // namespace fusible::kernels

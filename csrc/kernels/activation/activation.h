// The activation family's argument parsing and checks, shared by the ATen reference (CPU, Meta)
// and the CUDA kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels::reference {

/// kind in {gelu, qgelu, relu, srelu, silu}.
ActKind parse_activation(const char* op, std::string_view kind);
/// Gated kind in {glu, geglu, qgeglu, reglu, sreglu, swiglu}: the activation of the first half.
ActKind parse_gated(const char* op, std::string_view kind);
/// x [..., 2H] floating with an even last dim.
void check_glu_input(const char* op, const at::Tensor& x);
/// dy of x's shape with the last dim halved.
void check_glu_grad(const char* op, const at::Tensor& dy, const at::Tensor& x);
/// ClampedSwiGLU's limit (finite, >= 0), alpha and offset (finite): ValueError otherwise.
void check_clamped_params(const char* op, double limit, double alpha, double offset);
/// SiTUGLU's beta1 and beta2 (finite, > 0): ValueError otherwise.
void check_situ_params(const char* op, double beta1, double beta2);
/// scales of x's shape without the last dim, floating, on x's device.
void check_scales(const char* op, const at::Tensor& x, const at::Tensor& scales);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// activation.cpp.
namespace fusible::kernels {

/// kind in {gelu, qgelu, relu, srelu, silu}.
at::Tensor activation_fwd(const at::Tensor& x, const std::string& kind);
at::Tensor activation_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind);
/// kind in {glu, geglu, qgeglu, reglu, sreglu, swiglu}. x: [..., 2H] -> [..., H].
at::Tensor glu_fwd(const at::Tensor& x, const std::string& kind);
at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, const std::string& kind);
at::Tensor clamped_swiglu_fwd(const at::Tensor& x, double limit, double alpha, double offset);
at::Tensor clamped_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x, double limit, double alpha,
                              double offset);
at::Tensor situglu_fwd(const at::Tensor& x, double beta1, double beta2);
at::Tensor situglu_bwd(const at::Tensor& dy, const at::Tensor& x, double beta1, double beta2);
/// scales: x's shape without the last dim.
at::Tensor scaled_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales);
/// -> (dx, dscales).
std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& scales);
/// scaled_swiglu_bwd plus y = scales * swiglu(x) from the same pass -> (dx, dscales, y).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_swiglu_bwd_fwd(const at::Tensor& dy,
                                                                     const at::Tensor& x,
                                                                     const at::Tensor& scales);
at::Tensor scaled_situglu_fwd(const at::Tensor& x, const at::Tensor& scales, double beta1,
                              double beta2);
std::tuple<at::Tensor, at::Tensor> scaled_situglu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                      const at::Tensor& scales, double beta1,
                                                      double beta2);
at::Tensor scaled_clamped_swiglu_fwd(const at::Tensor& x, const at::Tensor& scales, double limit,
                                     double alpha, double offset);
std::tuple<at::Tensor, at::Tensor> scaled_clamped_swiglu_bwd(const at::Tensor& dy,
                                                             const at::Tensor& x,
                                                             const at::Tensor& scales, double limit,
                                                             double alpha, double offset);

}  // namespace fusible::kernels

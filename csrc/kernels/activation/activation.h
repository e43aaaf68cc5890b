// The activation family's argument parsing and checks, shared by the ATen reference (CPU, Meta)
// and the CUDA kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

#include <string_view>

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

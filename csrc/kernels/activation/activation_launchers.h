// Host launchers of the activation family's raw kernels (activation_kernels.cu): activations and
// the GLU family. ActKind is in kernels/common/launcher_types.h (the bias family takes it too).
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// GELU (tanh form) and quick GELU constants, shared by the CUDA kernels and the CPU reference.
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;
constexpr double kQGeluAlpha = 1.702;

/// A gated activation over [a | b] halves: act(a) * b, or
/// - kClamped (ClampedSwiGLU): a' = min(a, limit), b' = clamp(b, -limit, limit),
///   a' * sigmoid(alpha * a') * (b' + offset);
/// - kSitu (SiTUGLU): beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2).
enum class GluMode { kPlain, kClamped, kSitu };
struct GluParams {
  ActKind act = ActKind::kSilu;
  GluMode mode = GluMode::kPlain;
  double limit = 0;
  double alpha = 0;
  double offset = 1;
  double beta1 = 0;
  double beta2 = 0;
};

/// y = act(x), n elements.
void launch_activation_fwd(const void* x, void* y, int64_t n, ActKind act, KernelDType dtype,
                           int num_sms, cudaStream_t stream);
/// dx = dy * act'(x), n elements.
void launch_activation_bwd(const void* dy, const void* x, void* dx, int64_t n, ActKind act,
                           KernelDType dtype, int num_sms, cudaStream_t stream);
/// y[r, c] = scales[r] * gate(x[r, c], x[r, h + c]); scales (one per row, in the accumulation
/// type) may be null.
void launch_glu_fwd(const void* x,  // [rows, 2h]
                    void* y,        // [rows, h]
                    int64_t rows, int64_t h, const GluParams& params, const void* scales,
                    KernelDType dtype, int num_sms, cudaStream_t stream);
/// dx = [dy * scales * d gate / da | dy * scales * d gate / db].
void launch_glu_bwd(const void* dy,  // [rows, h]
                    const void* x,   // [rows, 2h]
                    void* dx,        // [rows, 2h]
                    int64_t rows, int64_t h, const GluParams& params, const void* scales,
                    KernelDType dtype, int num_sms, cudaStream_t stream);
/// launch_glu_bwd's dx (scales not null) and, in the same pass, dscales[r] = sum over c of
/// dy[r, c] * gate(x[r, c], x[r, h + c]) in the accumulation type, and (y not null) the forward's
/// y = scales * gate(x) [rows, h].
void launch_scaled_glu_bwd(const void* dy, const void* x, void* dx, void* dscales, void* y,
                           int64_t rows, int64_t h, const GluParams& params, const void* scales,
                           KernelDType dtype, int num_sms, cudaStream_t stream);

}  // namespace fusible::kernels

// Host launchers for the raw CUDA kernels: pointers, sizes and a stream, no torch types, so the .cu
// files compile with nvcc alone and the torch wrappers stay in host C++.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace fusible::kernels {

/// Element types the raw kernels are instantiated for.
enum class KernelDType { kFloat32, kFloat64, kFloat16, kBFloat16 };

/// y[m, n] = x[m, n] + bias[n]; all contiguous, row-major.
void launch_bias_fwd(const void* x,     // [rows, cols]
                     const void* bias,  // [cols]
                     void* y,           // [rows, cols]
                     int64_t rows, int64_t cols, KernelDType dtype, int num_sms,
                     cudaStream_t stream);

/// Partial column sums of dy over row chunks, then their total: dbias[n] = sum_m dy[m, n].
/// workspace holds num_chunks * cols accumulator values (float, or double for kFloat64); with one
/// chunk the sums go straight to dbias and workspace may be null.
void launch_bias_bwd(const void* dy,   // [rows, cols]
                     void* workspace,  // [num_chunks, cols], accumulator type
                     void* dbias,      // [cols]
                     int64_t rows, int64_t cols, int64_t num_chunks, KernelDType dtype,
                     cudaStream_t stream);

/// How many row chunks the column-sum passes (bias and norm-parameter gradients) split rows into:
/// enough blocks to fill the GPU.
int64_t column_sum_chunks(int64_t rows, int64_t cols, int num_sms);

// ---- LayerNorm (layernorm = true: mean subtracted, bias added) and RMSNorm over rows of cols.
// Statistics and workspaces are in the accumulation type: float, or double for kFloat64.

/// Whether a row of cols fits the kernels' shared memory, max_smem bytes per block (the device's
/// opt-in limit); else the caller falls back.
bool norm_fits(int64_t cols, KernelDType dtype, bool backward, int max_smem);

void launch_norm_fwd(const void* x,       // [rows, cols]
                     const void* weight,  // [cols]
                     const void* bias,    // [cols], LayerNorm only
                     void* y,             // [rows, cols]
                     void* mean,          // [rows], LayerNorm only
                     void* rstd,          // [rows]
                     int64_t rows, int64_t cols, double eps, bool zero_centered_gamma,
                     bool layernorm, KernelDType dtype, cudaStream_t stream);

/// dx (plus dextra when given), dweight and (LayerNorm) dbias.
void launch_norm_bwd(const void* dy,      // [rows, cols]
                     const void* x,       // [rows, cols]
                     const void* mean,    // [rows], LayerNorm only
                     const void* rstd,    // [rows]
                     const void* weight,  // [cols]
                     const void* dextra,  // [rows, cols] or null
                     void* dx,            // [rows, cols]
                     void* dweight,       // [cols]
                     void* dbias,         // [cols], LayerNorm only
                     void* workspace,     // [num_chunks, 2 * cols], accumulation type (chunks:
                                          // column_sum_chunks); null allowed for one chunk
                     int64_t rows, int64_t cols, int64_t num_chunks, bool zero_centered_gamma,
                     bool layernorm, KernelDType dtype, cudaStream_t stream);

}  // namespace fusible::kernels

namespace fusible::kernels {

// ---- Activations and the GLU family (activation_kernels.cu).

/// The activation applied elementwise, or to the first half of a gated pair.
enum class ActKind { kGelu, kQGelu, kRelu, kSRelu, kSilu, kSigmoid };

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

/// dpre = dy * act'(pre) (dpre may be dy: in place) and dbias = dpre summed over rows, in one pass
/// plus the partials' sum (bias_kernels.cu). Chunks and workspace as launch_bias_bwd.
void launch_bias_act_bwd(const void* dy, const void* pre, void* dpre, void* workspace, void* dbias,
                         int64_t rows, int64_t cols, int64_t num_chunks, ActKind act,
                         KernelDType dtype, cudaStream_t stream);

// ---- Scale and residual add (elementwise_kernels.cu).

/// y = scale * x, n elements.
void launch_scale(const void* x, void* y, int64_t n, double scale, KernelDType dtype, int num_sms,
                  cudaStream_t stream);
/// out = a + b, n elements; out may be a (in place).
void launch_add(const void* a, const void* b, void* out, int64_t n, KernelDType dtype, int num_sms,
                cudaStream_t stream);

}  // namespace fusible::kernels

namespace fusible::kernels {

// ---- Dropout (dropout_kernels.cu). The keep-mask is bits: element e is bit e % 8 of byte e / 8.

/// Philox seed and offset from PyTorch's CUDA generator; under CUDA-graph capture, device pointers
/// read at replay (seed_ptr, offset_ptr, plus offset as the in-graph increment).
struct PhiloxSeed {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
};

/// The forward's grid and how far each thread advances the generator (the offset increment).
struct DropoutLaunch {
  int64_t blocks = 0;
  uint64_t offset_increment = 0;
};
DropoutLaunch dropout_fwd_plan(int64_t n, int num_sms);

/// y = x * keep / (1 - p) with keep ~ Bernoulli(1 - p), mask (ceil(n / 8) bytes) the keep bits.
void launch_dropout_fwd(const void* x, void* y, void* mask, int64_t n, double p,
                        const DropoutLaunch& plan, const PhiloxSeed& rng, KernelDType dtype,
                        cudaStream_t stream);
/// dx = dy * keep / (1 - p) from the mask's bits.
void launch_dropout_bwd(const void* dy, const void* mask, void* dx, int64_t n, double p,
                        KernelDType dtype, int num_sms, cudaStream_t stream);

// ---- FP8 casts (fp8_kernels.cu).

/// y = x cast to FP8 (e4m3, else e5m2) and back, n elements. amax: one float of scratch that
/// receives amax(x) (zeroed here). Current scaling: scale is null and the cast's scale is
/// fmax / amax / 2^margin (1 where amax is 0 or not finite). Delayed scaling: scale [1] is the
/// cast's, and with history [history_len] the history then rolls (newest first) taking amax and
/// scale becomes fmax / (the history's max, or its newest with !use_max) / 2^margin.
void launch_fp8_qdq(const void* x, void* y, int64_t n, bool e4m3, double margin, float* amax,
                    float* scale, float* history, int64_t history_len, bool use_max,
                    KernelDType dtype, int num_sms, cudaStream_t stream);
/// x [rows, cols] cast to FP8 data [rows, cols] and, where data_t is not null, its transpose
/// [cols, rows] (cols, and with data_t rows, multiples of 4; x 16-byte aligned); *scale_inv = 1 /
/// the scale used. Current scaling (scale null): scale from amax(x) as launch_fp8_qdq. Delayed
/// (scale given): cast with *scale, amax(x) into *amax, then the history and scale update as there.
void launch_fp8_cast(const void* x, void* data, void* data_t, int64_t rows, int64_t cols, bool e4m3,
                     double margin, float* amax, float* scale, float* scale_inv, float* history,
                     int64_t history_len, bool use_max, KernelDType dtype, int num_sms,
                     cudaStream_t stream);
/// Block-scaled FP8 cast (fp8_block_kernels.cu) of x [rows, cols] (16-bit dtype, rows and cols
/// multiples of 128) in 1x128 (block_dim 1) or 128x128 (2) blocks with power-of-two scales: where
/// not null, data [rows, cols] with scale_inv in block_scale_shape(rows, cols) layout, and data_t
/// [cols, rows] (x^T cast the same way) with scale_inv_t in block_scale_shape(cols, rows) layout
/// (kernels/quantize_block.h; padding entries left as they are).
void launch_fp8_cast_block(const void* x, void* data, float* scale_inv, void* data_t,
                           float* scale_inv_t, int64_t rows, int64_t cols, int64_t block_dim,
                           bool e4m3, KernelDType dtype, cudaStream_t stream);

}  // namespace fusible::kernels

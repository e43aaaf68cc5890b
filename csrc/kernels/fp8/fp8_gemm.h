// fusible::fp8_gemm: a GEMM on FP8 data with per-tensor scales (the operands fp8_cast makes) or
// block scales (fp8_cast_block's: 1x128 blocks, or 128x128 for one operand), an
// epilogue (bias, residual, activation) and output in a wider dtype. Checks and the reference
// (dequantize, fp32 GEMM: the CPU emulation); CUDA runs it in cuBLASLt (fp8_gemm_cuda.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels {

/// Whether t holds FP8 data (torch.float8_e4m3fn or torch.float8_e5m2).
bool is_fp8(const at::Tensor& t);

/// fp8_gemm's checks: a [..., K] and b [N, K] FP8 on one device, not both E5M2; fp32 scale_invs
/// there; out_dtype bf16, fp16 or fp32; bias [N] and other in out_dtype; act 'none', 'gelu' or
/// 'relu' (an activation takes no other; save_pre needs one).
/// a_block / b_block: 0 per-tensor scale_inv ([1]), 1 or 2 block scales laid out as
/// block_scale_shape (kernels/fp8/fp8_block.h) says; not both 2.
void check_fp8_gemm_args(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, c10::string_view act,
                         bool save_pre, int64_t a_block = 0, int64_t b_block = 0,
                         const char* op = "fp8_gemm");

/// fp8_gemm_out's checks: fp8_gemm's (no other, no activation; errors naming fp8_gemm_out) and
/// out [..., N] on a's device.
void check_fp8_gemm_out_args(const at::Tensor& a, const at::Tensor& a_scale_inv,
                             const at::Tensor& b, const at::Tensor& b_scale_inv,
                             const at::Tensor& out, const std::optional<at::Tensor>& bias,
                             int64_t a_block, int64_t b_block);

namespace reference {
void fp8_gemm_out(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                  const at::Tensor& b_scale_inv, const at::Tensor& out,
                  const std::optional<at::Tensor>& bias, double alpha, bool fast_accum,
                  int64_t a_block, int64_t b_block, bool accumulate);
std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                                            at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& other, double alpha,
                                            c10::string_view act, bool save_pre, bool fast_accum,
                                            int64_t a_block, int64_t b_block);
}  // namespace reference

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// fp8_gemm.cpp.
namespace fusible::kernels {

/// act(alpha * deq(a) @ deq(b)^T + bias + other) in out_dtype -> (d, pre-activation or empty).
std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                                            at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& other, double alpha,
                                            const std::string& act, bool save_pre, bool fast_accum,
                                            int64_t a_block = 0, int64_t b_block = 0);

/// alpha * deq(a) @ deq(b)^T + bias written into out [..., N] (out's dtype); accumulate: added
/// to out (in fp32 for an fp32 out).
void fp8_gemm_out(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                  const at::Tensor& b_scale_inv, const at::Tensor& out,
                  const std::optional<at::Tensor>& bias = std::nullopt, double alpha = 1.0,
                  bool fast_accum = false, int64_t a_block = 0, int64_t b_block = 0,
                  bool accumulate = false);

}  // namespace fusible::kernels

// The cuBLASLt GEMM layer: one row-major GEMM with an epilogue, run on PyTorch's current stream
// with its cuBLASLt handle and workspace; algorithm heuristics cached per problem.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels::gemm {

enum class Epilogue {
  kNone,
  kBias,         // d += bias[n]
  kReluBias,     // d = relu(d + bias)
  kGeluBias,     // d = gelu_tanh(d + bias)
  kGeluAuxBias,  // aux = d + bias; d = gelu_tanh(aux)
  kDGeluBGrad,   // d = gelu_tanh'(aux) * d; bias = sum of d over rows (an output)
  kReluAuxBias,  // d = relu(d + bias); aux = the bit mask (d + bias > 0)
  kDReluBGrad,   // d = d where the aux bit is set, else 0; bias = sum of d over rows (an output)
  kBGradB,       // plain d; bias[i] = sum over k of op(a)[i, :] (an output, m elements): the
                 // bias gradient of a wgrad GEMM whose op(a) is dy^T
};

/// The ReLU bit mask's row length in bytes for an output with n columns: cuBLASLt wants its
/// leading dim, in bits, a multiple of 128. Bit j of row i is bit (j % 8) of byte i * ld + j / 8.
int64_t relu_mask_row_bytes(int64_t n);

const char* epilogue_name(Epilogue e);

/// Row-major d[m, n] = alpha * op(a) @ op(b) + beta * c, then the epilogue. op(a) is [m, k]: a is
/// [m, k], or [k, m] with trans_a; op(b) is [k, n]: b is [k, n], or [n, k] with trans_b. Every
/// tensor is 2-D, contiguous, on one CUDA device, of one dtype (bf16, fp16 or fp32), or bf16 /
/// fp16 a and b with fp32 c and d and no epilogue (fp32 accumulation into c); or, FP8, a
/// and b are float8_e4m3fn / float8_e5m2 (not both e5m2) with their scale_inv, a [m, k] and b
/// [n, k] with trans_b (the one layout Hopper's FP8 GEMM takes: k contiguous in both), and d,
/// c and bias bf16 or fp16 (fp32 d without a bias).
struct RowMajorGemm {
  at::Tensor a, b;
  bool trans_a = false;
  bool trans_b = false;
  at::Tensor d;  // output [m, n]
  at::Tensor c;  // optional [m, n], scaled by beta (may be d itself: in place)
  double alpha = 1.0;
  double beta = 0.0;
  Epilogue epilogue = Epilogue::kNone;
  // [n]: input (kBias, kReluBias, kGeluBias, kGeluAuxBias, kReluAuxBias), output (kDGeluBGrad,
  // kDReluBGrad); [m]: output (kBGradB).
  at::Tensor bias;
  // [m, n] in d's dtype: output (kGeluAuxBias) or input (kDGeluBGrad); uint8
  // [m, relu_mask_row_bytes(n)]: output (kReluAuxBias) or input (kDReluBGrad).
  at::Tensor aux;
  // FP8 only: fp32 [1] each, on the device; op(a) is a * a_scale_inv, op(b) b * b_scale_inv.
  // With a_block / b_block 1 or 2 (Hopper's block scaling: 1x128 or 128x128 blocks, not both
  // 128x128), the block scales in the layout of kernels/fp8/fp8_block.h.
  at::Tensor a_scale_inv, b_scale_inv;
  int64_t a_block = 0, b_block = 0;
  bool fast_accum = false;  // FP8 only: cuBLASLt's fast accumulation (forward GEMMs)
};

/// Whether cuBLASLt runs this GEMM here: supported dtype, 16-byte aligned pointers and rows, and
/// the epilogue's layout rules (the GELU aux leading dim a multiple of 8, the ReLU mask as above).
/// Callers fall back to the ATen reference otherwise.
bool can_run(const RowMajorGemm& g);

/// Runs it. Throws naming m, n, k, dtype and epilogue when no algorithm fits.
void run(const RowMajorGemm& g);

/// Runs it where cuBLASLt has an algorithm for it (false, nothing run, otherwise): for epilogues
/// an FP8 GEMM may lack.
bool try_run(const RowMajorGemm& g);

}  // namespace fusible::kernels::gemm

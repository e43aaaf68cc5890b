// The cuBLASLt GEMM layer: one row-major GEMM with an epilogue, run on PyTorch's current stream
// with its cuBLASLt handle and workspace; algorithm heuristics cached per problem.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::kernels::gemm {

enum class Epilogue {
  kNone,
  kBias,         // d += bias[n]
  kReluBias,     // d = relu(d + bias)
  kGeluAuxBias,  // aux = d + bias; d = gelu_tanh(aux)
  kDGeluBGrad,   // d = gelu_tanh'(aux) * d; bias = sum of d over rows (an output)
};

const char* epilogue_name(Epilogue e);

/// Row-major d[m, n] = alpha * op(a) @ op(b) + beta * c, then the epilogue. op(a) is [m, k]: a is
/// [m, k], or [k, m] with trans_a; op(b) is [k, n]: b is [k, n], or [n, k] with trans_b. Every
/// tensor is 2-D, contiguous, on one CUDA device, of one dtype (bf16, fp16 or fp32).
struct RowMajorGemm {
  at::Tensor a, b;
  bool trans_a = false;
  bool trans_b = false;
  at::Tensor d;  // output [m, n]
  at::Tensor c;  // optional [m, n], scaled by beta (may be d itself: in place)
  double alpha = 1.0;
  double beta = 0.0;
  Epilogue epilogue = Epilogue::kNone;
  at::Tensor bias;  // [n]: input (kBias, kReluBias, kGeluAuxBias) or output (kDGeluBGrad)
  at::Tensor aux;   // [m, n]: output (kGeluAuxBias) or input (kDGeluBGrad)
};

/// Whether cuBLASLt runs this GEMM here: supported dtype, 16-byte aligned pointers and rows, and
/// the epilogue's layout rules (the GELU aux leading dim a multiple of 8). Callers fall back to
/// the ATen reference otherwise.
bool can_run(const RowMajorGemm& g);

/// Runs it. Throws naming m, n, k, dtype and epilogue when no algorithm fits.
void run(const RowMajorGemm& g);

}  // namespace fusible::kernels::gemm

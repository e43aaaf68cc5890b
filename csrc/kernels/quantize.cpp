// fp8_quantize_dequantize: checks, the ATen version (CPU, and CUDA until its fused kernel), Meta.
#include "kernels/quantize.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <cmath>

#include "common/checks.h"

namespace fusible::kernels {

double fp8_max(const char* op, c10::string_view format) {
  if (format == "e4m3") return 448.0;
  TORCH_CHECK_VALUE(format == "e5m2", op, ": expected format 'e4m3' or 'e5m2', got '", format, "'");
  return 57344.0;
}

void check_fp8_qdq_args(const at::Tensor& x, c10::string_view format, double margin) {
  FUSIBLE_CHECK_FLOATING("fp8_quantize_dequantize", "x", x);
  fp8_max("fp8_quantize_dequantize", format);
  TORCH_CHECK_VALUE(std::isfinite(margin),
                    "fp8_quantize_dequantize: expected a finite margin, got ", margin);
}

namespace reference {

at::Tensor fp8_quantize_dequantize(const at::Tensor& x, c10::string_view format, double margin) {
  check_fp8_qdq_args(x, format, margin);
  if (x.numel() == 0) return x.clone();
  const double max = fp8_max("fp8_quantize_dequantize", format);
  const auto fp8 = format == "e4m3" ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  // fp32 math (fp64 stays fp64), as the CUDA cast kernel does.
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto amax = xf.abs().amax();
  const auto scale = at::where(at::isfinite(amax) & (amax > 0), max / amax * std::exp2(-margin),
                               at::ones_like(amax));
  const auto q = (xf * scale).clamp(-max, max).to(fp8);
  return (q.to(xf.scalar_type()) * scale.reciprocal()).to(x.scalar_type());
}

}  // namespace reference

namespace {

at::Tensor fp8_qdq_meta(const at::Tensor& x, c10::string_view format, double margin) {
  check_fp8_qdq_args(x, format, margin);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("fp8_quantize_dequantize", &reference::fp8_quantize_dequantize);
}

// CUDA runs the same ATen code for now (correct, not fast); the fused amax + scale + cast kernel
// comes with the FP8 GEMMs.
TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("fp8_quantize_dequantize", &reference::fp8_quantize_dequantize);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) { m.impl("fp8_quantize_dequantize", &fp8_qdq_meta); }

}  // namespace fusible::kernels

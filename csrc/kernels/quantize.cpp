// fp8_quantize_dequantize(_delayed): checks, the ATen version (CPU), Meta. CUDA:
// quantize_cuda.cpp.
#include "kernels/quantize.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
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

void check_fp8_qdq_delayed_args(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax_history, const at::Tensor& scale,
                                double margin, c10::string_view amax_compute_algo) {
  constexpr const char* op = "fp8_quantize_dequantize_delayed";
  check_fp8_qdq_args(x, format, margin);
  FUSIBLE_CHECK_DIM(op, "amax_history", amax_history, 1);
  TORCH_CHECK_VALUE(amax_history.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat,
                    op, ": expected a float32 amax_history and scale, got ",
                    amax_history.scalar_type(), " and ", scale.scalar_type());
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "amax_history", amax_history);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "scale", scale);
  TORCH_CHECK_VALUE(amax_compute_algo == "max" || amax_compute_algo == "most_recent", op,
                    ": expected amax_compute_algo 'max' or 'most_recent', got '", amax_compute_algo,
                    "'");
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

at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, c10::string_view format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, c10::string_view amax_compute_algo) {
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  // Sizes here, not in the checks the Meta kernel shares (symbolic sizes have no numel()).
  TORCH_CHECK_VALUE(amax_history.numel() >= 1 && scale.numel() == 1,
                    "fp8_quantize_dequantize_delayed: expected a non-empty amax_history and a "
                    "one-element scale, got ",
                    amax_history.numel(), " and ", scale.numel(), " elements");
  const double max = fp8_max("fp8_quantize_dequantize_delayed", format);
  const auto fp8 = format == "e4m3" ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto s = scale.reshape({}).to(xf.scalar_type());
  const auto y =
      ((xf * s).clamp(-max, max).to(fp8).to(xf.scalar_type()) * s.reciprocal()).to(x.scalar_type());
  // The history rolls by one, newest first; then the scale for the next cast.
  const auto amax = x.numel() > 0 ? xf.abs().amax().to(at::kFloat) : at::zeros({}, scale.options());
  const auto len = amax_history.size(0);
  if (len > 1) amax_history.slice(0, 1).copy_(amax_history.slice(0, 0, len - 1).clone());
  amax_history.select(0, 0).copy_(amax);
  const auto used = amax_compute_algo == "max" ? amax_history.amax() : amax_history.select(0, 0);
  const auto fresh = max / used * std::exp2(-margin);
  scale.copy_(
      at::where(at::isfinite(used) & (used > 0), fresh, scale.reshape({})).reshape(scale.sizes()));
  return y;
}

}  // namespace reference

namespace {

at::Tensor fp8_qdq_meta(const at::Tensor& x, c10::string_view format, double margin) {
  check_fp8_qdq_args(x, format, margin);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

at::Tensor fp8_qdq_delayed_meta(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax_history, const at::Tensor& scale,
                                double margin, c10::string_view amax_compute_algo) {
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("fp8_quantize_dequantize", &reference::fp8_quantize_dequantize);
  m.impl("fp8_quantize_dequantize_delayed", &reference::fp8_quantize_dequantize_delayed);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) {
  m.impl("fp8_quantize_dequantize", &fp8_qdq_meta);
  m.impl("fp8_quantize_dequantize_delayed", &fp8_qdq_delayed_meta);
}

}  // namespace fusible::kernels

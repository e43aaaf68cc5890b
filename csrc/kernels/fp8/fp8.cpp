// fp8_quantize_dequantize(_delayed, _block) and fp8_cast(_delayed): checks, the ATen version
// (CPU), Meta. CUDA: fp8_cuda.cpp.
#include "kernels/fp8/fp8.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/frexp.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/ldexp.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/repeat_interleave.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "common/checks.h"
#include "kernels/activation/activation.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {

namespace {
// On by default (measured on the H200: the small MLP's FP8 step 23% less host time);
// FUSIBLE_FP8_CAST_ONE_LAUNCH=0 starts a process with the plain launches.
bool one_launch_from_env() {
  const char* v = std::getenv("FUSIBLE_FP8_CAST_ONE_LAUNCH");
  return v == nullptr || std::string(v) != "0";
}
std::atomic<bool> one_launch{one_launch_from_env()};
}  // namespace

bool fp8_cast_one_launch() { return one_launch.load(std::memory_order_relaxed); }
void set_fp8_cast_one_launch(bool on) { one_launch.store(on, std::memory_order_relaxed); }

int64_t leading_rows(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

double fp8_max(const char* op, c10::string_view format) {
  if (format == "e4m3") return 448.0;
  TORCH_CHECK_VALUE(format == "e5m2", op, ": expected format 'e4m3' or 'e5m2', got '", format, "'");
  return 57344.0;
}

at::ScalarType fp8_dtype(const char* op, c10::string_view format) {
  fp8_max(op, format);
  return format == "e4m3" ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
}

void check_fp8_cast_args(const char* op, const at::Tensor& x, c10::string_view format,
                         double margin) {
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_MIN_DIM(op, "x", x, 1);
  fp8_max(op, format);
  TORCH_CHECK_VALUE(std::isfinite(margin), op, ": expected a finite margin, got ", margin);
}

std::optional<ActKind> cast_activation(const char* op, c10::string_view act) {
  if (act == "none") return std::nullopt;
  return reference::parse_activation(op, std::string_view(act.data(), act.size()));
}

at::Tensor cast_source(const char* op, const at::Tensor& x, c10::string_view act) {
  if (!cast_activation(op, act)) return x;
  return activation_fwd(x, std::string(act));
}

void check_fp8_amax_arg(const char* op, const at::Tensor& x, const at::Tensor& amax) {
  TORCH_CHECK_VALUE(amax.scalar_type() == at::kFloat && amax.dim() == 1 && amax.sym_size(0) == 1,
                    op, ": expected amax to be a float32 tensor of shape [1], got ",
                    amax.scalar_type(), " of shape ", amax.sym_sizes());
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "amax", amax);
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

void check_fp8_qdq_block_args(const at::Tensor& x, c10::string_view format, int64_t block_dim) {
  check_fp8_qdq_args(x, format, 0.0);
  FUSIBLE_CHECK_MIN_DIM("fp8_quantize_dequantize_block", "x", x, 1);
  TORCH_CHECK_VALUE(block_dim == 1 || block_dim == 2,
                    "fp8_quantize_dequantize_block: expected block_dim 1 (1x128 blocks) or 2 "
                    "(128x128), got ",
                    block_dim);
}

at::Tensor reference::abs_max(const at::Tensor& x, at::IntArrayRef dims) {
  const auto a = x.abs();
  return a.masked_fill(a.isnan(), 0).amax(dims);
}

// The largest float where the division overflows (a tiny amax), as TransformerEngine does: an
// infinite scale would turn zeros into NaN.
at::Tensor reference::scale_for(const at::Tensor& amax, double max, double factor,
                                const at::Tensor& fallback) {
  const auto raw = (max / amax * factor).clamp_max(std::numeric_limits<float>::max());
  return at::where(at::isfinite(amax) & (amax > 0), raw, fallback);
}

namespace {

using reference::scale_for;

// Delayed scaling after a cast of xf: the history rolls by one, newest first, taking amax(xf); then
// the scale for the next cast. Neither changes where amax(xf) is 0.
void roll_history(const at::Tensor& xf, const at::Tensor& amax_history, const at::Tensor& scale,
                  double max, double margin, c10::string_view amax_compute_algo) {
  const auto amax =
      xf.numel() > 0 ? reference::abs_max(xf).to(at::kFloat) : at::zeros({}, scale.options());
  // An amax of 0 (an empty or all-zero x) leaves history and scale as they are (te's update);
  // chosen on the device, without a host synchronization.
  const auto rolls = amax != 0;
  const auto len = amax_history.size(0);
  const auto rolled = at::cat({amax.reshape({1}), amax_history.slice(0, 0, len - 1)});
  amax_history.copy_(at::where(rolls, rolled, amax_history));
  const auto used = amax_compute_algo == "max" ? amax_history.amax() : amax_history.select(0, 0);
  const auto old = scale.reshape({});
  scale.copy_(
      at::where(rolls, scale_for(used, max, std::exp2(-margin), old), old).reshape(scale.sizes()));
}

void check_delayed_state_sizes(const char* op, const at::Tensor& amax_history,
                               const at::Tensor& scale) {
  // Sizes here, not in the checks the Meta kernels share (symbolic sizes have no numel()).
  TORCH_CHECK_VALUE(amax_history.numel() >= 1 && scale.numel() == 1, op,
                    ": expected a non-empty amax_history and a one-element scale, got ",
                    amax_history.numel(), " and ", scale.numel(), " elements");
}

// xf (fp32, or fp64) times scale (a 0-d tensor) as FP8 data, its [K, M] transpose if asked for,
// and 1 / scale as [1] fp32.
Fp8Cast cast_with(const at::Tensor& xf, const at::Tensor& scale, double max, at::ScalarType fp8,
                  bool transpose) {
  const auto data = (xf * scale).clamp(-max, max).to(fp8).contiguous();
  const auto data_t = transpose ? data.reshape({leading_rows(data), data.size(-1)}).t().contiguous()
                                : at::empty({0}, data.options());
  return {data, data_t, scale.reciprocal().to(at::kFloat).reshape({1})};
}

}  // namespace

namespace reference {

at::Tensor fp8_quantize_dequantize(const at::Tensor& x, c10::string_view format, double margin) {
  check_fp8_qdq_args(x, format, margin);
  if (x.numel() == 0) return x.clone();
  const double max = fp8_max("fp8_quantize_dequantize", format);
  const auto fp8 = fp8_dtype("fp8_quantize_dequantize", format);
  // fp32 math (fp64 stays fp64), as the CUDA cast kernel does.
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto amax = abs_max(xf);
  const auto scale = scale_for(amax, max, std::exp2(-margin), at::ones_like(amax));
  const auto q = (xf * scale).clamp(-max, max).to(fp8);
  return (q.to(xf.scalar_type()) * scale.reciprocal()).to(x.scalar_type()).contiguous();
}

at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, c10::string_view format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, c10::string_view amax_compute_algo) {
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  check_delayed_state_sizes("fp8_quantize_dequantize_delayed", amax_history, scale);
  const double max = fp8_max("fp8_quantize_dequantize_delayed", format);
  const auto fp8 = fp8_dtype("fp8_quantize_dequantize_delayed", format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto s = scale.reshape({}).to(xf.scalar_type());
  const auto y =
      ((xf * s).clamp(-max, max).to(fp8).to(xf.scalar_type()) * s.reciprocal()).to(x.scalar_type());
  roll_history(xf, amax_history, scale, max, margin, amax_compute_algo);
  return y.contiguous();
}

at::Tensor block_scales(const at::Tensor& x2d, double max, int64_t block_dim, bool power_2_scale) {
  constexpr int64_t kBlock = 128;
  const int64_t rows = x2d.size(0), cols = x2d.size(1);
  const auto up = [](int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; };
  const int64_t prows = block_dim == 2 ? up(rows) : rows, pcols = up(cols);
  // Zero padding to whole blocks: it changes no block's amax.
  const auto padded = at::constant_pad_nd(x2d, {0, pcols - cols, 0, prows - rows}, 0);
  const auto amax =
      block_dim == 2
          ? abs_max(padded.view({prows / kBlock, kBlock, pcols / kBlock, kBlock}), {1, 3})
          : abs_max(padded.view({prows, pcols / kBlock, kBlock}), {2});
  auto scale = scale_for(amax, max, 1.0, at::ones_like(amax));
  if (power_2_scale) {
    // Rounded down to a power of two through the exponent (exact, as the CUDA kernel): scale =
    // m * 2^e with m in [0.5, 1) -> 2^(e - 1); at most 2^127 (scale is at most FLT_MAX).
    const auto exponent = std::get<1>(at::frexp(scale));
    scale = at::ldexp(at::ones_like(scale), exponent - 1);
  }
  return scale;
}

at::Tensor expand_block_scales(const at::Tensor& scale, int64_t rows, int64_t cols,
                               int64_t block_dim) {
  constexpr int64_t kBlock = 128;
  auto s = scale.repeat_interleave(kBlock, 1).slice(1, 0, cols);
  if (block_dim == 2) s = s.repeat_interleave(kBlock, 0).slice(0, 0, rows);
  return s;
}

at::Tensor fp8_quantize_dequantize_block(const at::Tensor& x, c10::string_view format,
                                         int64_t block_dim, bool power_2_scale) {
  check_fp8_qdq_block_args(x, format, block_dim);
  if (x.numel() == 0) return x.clone();
  const double max = fp8_max("fp8_quantize_dequantize_block", format);
  const auto fp8 = fp8_dtype("fp8_quantize_dequantize_block", format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const auto x2d = xf.reshape({rows, cols});
  const auto scale =
      expand_block_scales(block_scales(x2d, max, block_dim, power_2_scale), rows, cols, block_dim);
  const auto q = (x2d * scale).clamp(-max, max).to(fp8).to(xf.scalar_type()) * scale.reciprocal();
  return q.reshape(x.sizes()).to(x.scalar_type()).contiguous();
}

at::Tensor amax_of(const at::Tensor& x) {
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto m = x.sym_numel() > 0 ? abs_max(xf) : at::zeros({}, xf.options());
  return m.to(at::kFloat).reshape({1});
}

Fp8Cast fp8_cast(const at::Tensor& x_in, c10::string_view format, double margin, bool transpose,
                 c10::string_view act) {
  check_fp8_cast_args("fp8_cast", x_in, format, margin);
  const auto x = cast_source("fp8_cast", x_in, act);
  const double max = fp8_max("fp8_cast", format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto amax = x.numel() > 0 ? abs_max(xf) : at::zeros({}, xf.options());
  const auto scale = scale_for(amax, max, std::exp2(-margin), at::ones_like(amax));
  return cast_with(xf, scale.to(at::kFloat), max, fp8_dtype("fp8_cast", format), transpose);
}

Fp8Cast fp8_cast_with_amax(const at::Tensor& x, c10::string_view format, const at::Tensor& amax,
                           double margin, bool transpose) {
  constexpr const char* op = "fp8_cast_with_amax";
  check_fp8_cast_args(op, x, format, margin);
  check_fp8_amax_arg(op, x, amax);
  const double max = fp8_max(op, format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  const auto m = amax.reshape({}).to(xf.scalar_type());
  const auto scale = scale_for(m, max, std::exp2(-margin), at::ones_like(m));
  return cast_with(xf, scale.to(at::kFloat), max, fp8_dtype(op, format), transpose);
}

Fp8Cast fp8_cast_delayed(const at::Tensor& x_in, c10::string_view format,
                         const at::Tensor& amax_history, const at::Tensor& scale, double margin,
                         c10::string_view amax_compute_algo, bool transpose, c10::string_view act) {
  constexpr const char* op = "fp8_cast_delayed";
  check_fp8_cast_args(op, x_in, format, margin);
  check_fp8_qdq_delayed_args(x_in, format, amax_history, scale, margin, amax_compute_algo);
  check_delayed_state_sizes(op, amax_history, scale);
  const auto x = cast_source(op, x_in, act);
  const double max = fp8_max(op, format);
  const auto xf = x.scalar_type() == at::kDouble ? x : x.to(at::kFloat);
  auto out = cast_with(xf, scale.reshape({}).clone(), max, fp8_dtype(op, format), transpose);
  roll_history(xf, amax_history, scale, max, margin, amax_compute_algo);
  return out;
}

}  // namespace reference

namespace {

Fp8Cast fp8_cast_meta_outputs(const at::Tensor& x, c10::string_view format, bool transpose) {
  const auto data = at::empty_like(x, x.options().dtype(fp8_dtype("fp8_cast", format)),
                                   at::MemoryFormat::Contiguous);
  c10::SymInt rows = 1;  // from the leading dims: a tensor with no columns still has rows
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.sym_size(d);
  const auto data_t = transpose ? at::empty_symint({x.sym_size(-1), rows}, data.options())
                                : at::empty({0}, data.options());
  return {data, data_t, at::empty({1}, x.options().dtype(at::kFloat))};
}

Fp8Cast fp8_cast_meta(const at::Tensor& x, c10::string_view format, double margin, bool transpose,
                      c10::string_view act) {
  check_fp8_cast_args("fp8_cast", x, format, margin);
  cast_activation("fp8_cast", act);
  return fp8_cast_meta_outputs(x, format, transpose);
}

Fp8Cast fp8_cast_with_amax_meta(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax, double margin, bool transpose) {
  check_fp8_cast_args("fp8_cast_with_amax", x, format, margin);
  check_fp8_amax_arg("fp8_cast_with_amax", x, amax);
  return fp8_cast_meta_outputs(x, format, transpose);
}

Fp8Cast fp8_cast_delayed_meta(const at::Tensor& x, c10::string_view format,
                              const at::Tensor& amax_history, const at::Tensor& scale,
                              double margin, c10::string_view amax_compute_algo, bool transpose,
                              c10::string_view act) {
  check_fp8_cast_args("fp8_cast_delayed", x, format, margin);
  cast_activation("fp8_cast_delayed", act);
  check_fp8_qdq_delayed_args(x, format, amax_history, scale, margin, amax_compute_algo);
  return fp8_cast_meta_outputs(x, format, transpose);
}

at::Tensor fp8_qdq_block_meta(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                              bool power_2_scale) {
  check_fp8_qdq_block_args(x, format, block_dim);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

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

// ---- Entry points for C++ callers (declared in fp8.h).

at::Tensor fp8_quantize_dequantize(const at::Tensor& x, const std::string& format, double margin) {
  FUSIBLE_DISPATCH(fp8_quantize_dequantize, x, format, margin);
}
at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, const std::string& format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, const std::string& amax_compute_algo) {
  FUSIBLE_DISPATCH(fp8_quantize_dequantize_delayed, x, format, amax_history, scale, margin,
                   amax_compute_algo);
}
at::Tensor fp8_quantize_dequantize_block(const at::Tensor& x, const std::string& format,
                                         int64_t block_dim, bool power_2_scale) {
  FUSIBLE_DISPATCH(fp8_quantize_dequantize_block, x, format, block_dim, power_2_scale);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast(const at::Tensor& x,
                                                        const std::string& format, double margin,
                                                        bool transpose, const std::string& act) {
  FUSIBLE_DISPATCH(fp8_cast, x, format, margin, transpose, act);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_with_amax(const at::Tensor& x,
                                                                  const std::string& format,
                                                                  const at::Tensor& amax,
                                                                  double margin, bool transpose) {
  FUSIBLE_DISPATCH(fp8_cast_with_amax, x, format, amax, margin, transpose);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_delayed(
    const at::Tensor& x, const std::string& format, const at::Tensor& amax_history,
    const at::Tensor& scale, double margin, const std::string& amax_compute_algo, bool transpose,
    const std::string& act) {
  FUSIBLE_DISPATCH(fp8_cast_delayed, x, format, amax_history, scale, margin, amax_compute_algo,
                   transpose, act);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // FP8 (current scaling): x cast to FP8 format 'e4m3' or 'e5m2' with scale = fp8_max / amax(x) /
  // 2^margin, and back to x's dtype: the values an FP8 GEMM computes with (CPU emulation).
  define(m, "fp8_quantize_dequantize(Tensor x, str format, float margin=0.0) -> Tensor");
  // FP8 (delayed scaling): x cast with `scale` and back; then amax(x) enters amax_history
  // (newest first) and scale becomes fp8_max / (its max, or newest, amax) / 2^margin; neither
  // changes where amax(x) is 0.
  define(m,
         "fp8_quantize_dequantize_delayed(Tensor x, str format, Tensor(a!) amax_history, "
         "Tensor(b!) scale, float margin, str amax_compute_algo) -> Tensor");
  // FP8 (block scaling): x as [rows, last dim] in 1x128 (block_dim 1) or 128x128 (block_dim 2)
  // blocks, each cast with its own scale (a power of two with power_2_scale) and back.
  define(
      m,
      "fp8_quantize_dequantize_block(Tensor x, str format, int block_dim, bool power_2_scale=True)"
      " -> Tensor");
  // FP8 data for a GEMM (current scaling): -> (data in x's shape, data_t [K, M] for x as [M, K]
  // rows (empty unless transpose), scale_inv [1] fp32); data = fp8(x * scale). act: "none", or
  // an elementwise activation ("gelu", ...) applied to x on the way in: the cast of an
  // activation's output from its input, no tensor of the output written.
  define(m,
         "fp8_cast(Tensor x, str format, float margin=0.0, bool transpose=False, str act=\"none\") "
         "-> (Tensor, Tensor, Tensor)");
  // fp8_cast with amax(x) given ([1] fp32, as the kernel that wrote x computed it: NaN or inf
  // gives scale 1): the cast without its own amax pass.
  define(m,
         "fp8_cast_with_amax(Tensor x, str format, Tensor amax, float margin=0.0, bool "
         "transpose=False) -> (Tensor, Tensor, Tensor)");
  // max |x| as [1] fp32 (NaN elements left out, 0 for an empty x): the amax every cast takes,
  // for code outside the casts that records one (the FP8 weight's delayed-scaling state).
  define(m, "fp8_amax(Tensor x) -> Tensor");
  // The same with delayed scaling's scale, then its history and scale updated.
  define(m,
         "fp8_cast_delayed(Tensor x, str format, Tensor(a!) amax_history, Tensor(b!) scale, "
         "float margin, str amax_compute_algo, bool transpose=False, str act=\"none\") -> (Tensor, "
         "Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("fp8_quantize_dequantize", &reference::fp8_quantize_dequantize);
  m.impl("fp8_quantize_dequantize_delayed", &reference::fp8_quantize_dequantize_delayed);
  m.impl("fp8_quantize_dequantize_block", &reference::fp8_quantize_dequantize_block);
  m.impl("fp8_cast", &reference::fp8_cast);
  m.impl("fp8_cast_with_amax", &reference::fp8_cast_with_amax);
  m.impl("fp8_cast_delayed", &reference::fp8_cast_delayed);
}

// ATen calls only: one implementation for every device.
TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("fp8_amax", &reference::amax_of);
}

// Block scaling on CUDA: the same ATen code until its kernel comes with the block-scaled GEMMs.
TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("fp8_quantize_dequantize_block", &reference::fp8_quantize_dequantize_block);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) {
  m.impl("fp8_quantize_dequantize_block", &fp8_qdq_block_meta);
  m.impl("fp8_quantize_dequantize", &fp8_qdq_meta);
  m.impl("fp8_quantize_dequantize_delayed", &fp8_qdq_delayed_meta);
  m.impl("fp8_cast", &fp8_cast_meta);
  m.impl("fp8_cast_with_amax", &fp8_cast_with_amax_meta);
  m.impl("fp8_cast_delayed", &fp8_cast_delayed_meta);
}

}  // namespace fusible::kernels

// FP8 casts: per-tensor current scaling (the scale comes from the tensor's own amax when it is
// cast), delayed scaling (from an amax history) and block scaling; each as a cast and back (the
// values an FP8 GEMM computes with) and, per tensor, as the FP8 data a GEMM reads (fp8_cast).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// The rows of t as [rows, t.size(-1)]: the product of its leading dims (1 for a 1-D t), also
/// where it has no columns.
int64_t leading_rows(const at::Tensor& t);

/// The largest finite value of an FP8 format: "e4m3" 448, "e5m2" 57344 (throws naming op on any
/// other name).
double fp8_max(const char* op, c10::string_view format);

/// torch.float8_e4m3fn for "e4m3", torch.float8_e5m2 for "e5m2" (throws naming op otherwise).
at::ScalarType fp8_dtype(const char* op, c10::string_view format);

/// The argument checks of fp8_quantize_dequantize.
void check_fp8_qdq_args(const at::Tensor& x, c10::string_view format, double margin);

/// The argument checks of fp8_quantize_dequantize_delayed.
void check_fp8_qdq_delayed_args(const at::Tensor& x, c10::string_view format,
                                const at::Tensor& amax_history, const at::Tensor& scale,
                                double margin, c10::string_view amax_compute_algo);

/// The argument checks of fp8_quantize_dequantize_block.
void check_fp8_qdq_block_args(const at::Tensor& x, c10::string_view format, int64_t block_dim);

/// The argument checks of fp8_cast (and of fp8_cast_delayed's x, format and margin).
void check_fp8_cast_args(const char* op, const at::Tensor& x, c10::string_view format,
                         double margin);

/// The `act` argument of the casts: "none" (nullopt), or an elementwise activation (gelu, qgelu,
/// relu, srelu, silu) whose output the cast reads in place of x, computed from x on the way in.
std::optional<ActKind> cast_activation(const char* op, c10::string_view act);

/// The tensor a cast with `act` reads where no kernel applies the activation on load: x itself, or
/// activation_fwd(x) in x's dtype (on x's device).
at::Tensor cast_source(const char* op, const at::Tensor& x, c10::string_view act);

/// fp8_cast_with_amax's amax: float32 [1] on x's device.
void check_fp8_amax_arg(const char* op, const at::Tensor& x, const at::Tensor& amax);

/// fp8_cast_grouped's checks: x [T, K] floating, sizes non-negative and adding up to T.
void check_fp8_cast_grouped_args(const at::Tensor& x, at::IntArrayRef sizes,
                                 c10::string_view format, double margin);

/// Whether the CUDA fp8_cast and fp8_cast_delayed of a small tensor run as one cooperative launch
/// (on by default; off where the process starts with FUSIBLE_FP8_CAST_ONE_LAUNCH=0: the plain
/// launches, as for a large tensor). The same bytes either way.
bool fp8_cast_one_launch();
void set_fp8_cast_one_launch(bool on);

/// fp8_cast's outputs: data in x's shape, data_t [K, M] for x as [M, K] rows (empty [0] unless
/// asked for), scale_inv [1] fp32.
using Fp8Cast = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

namespace reference {
/// max |x| over dims (every element without dims), NaN elements left out as TransformerEngine's
/// amax leaves them out (fmaxf): a NaN stays NaN in the cast but does not set the other elements'
/// scale, nor enter a delayed-scaling history. An infinity counts (its scale falls back to 1).
at::Tensor abs_max(const at::Tensor& x, at::IntArrayRef dims = {});
/// The scale of a cast from the amax it uses: fp8_max `max` / amax * factor, `fallback` where amax
/// is 0 or not finite (elementwise; float32).
at::Tensor scale_for(const at::Tensor& amax, double max, double factor, const at::Tensor& fallback);
/// x cast to FP8 with scale = fp8_max / amax(x) / 2^margin (1 where amax is 0 or not finite) and
/// back: x's values as an FP8 GEMM sees them, in x's dtype. ATen, any device.
at::Tensor fp8_quantize_dequantize(const at::Tensor& x, c10::string_view format, double margin);
/// Delayed scaling: x cast with the given scale [1] and back; then amax(x) enters amax_history
/// (newest first, the oldest dropped) and scale becomes fp8_max / amax / 2^margin, amax being the
/// history's max or its newest entry (amax_compute_algo "max" / "most_recent"); unchanged where
/// that amax is 0 or not finite. An amax(x) of 0 (x empty or all zeros) leaves history and scale
/// as they are, as te's update. All on the device: no host synchronization.
at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, c10::string_view format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, c10::string_view amax_compute_algo);
/// Block scaling: x as [rows, last dim] in blocks of 1x128 (block_dim 1) or 128x128 (block_dim
/// 2), each cast with scale = fp8_max / its amax (1 where that is 0 or not finite; rounded down to
/// a power of two with power_2_scale) and back.
at::Tensor fp8_quantize_dequantize_block(const at::Tensor& x, c10::string_view format,
                                         int64_t block_dim, bool power_2_scale);
/// The scale of each block of x2d [rows, cols] (float): [rows, ceil(cols / 128)] for 1x128
/// blocks (block_dim 1), [ceil(rows / 128), ceil(cols / 128)] for 128x128 (block_dim 2); fp8_max /
/// the block's amax, 1 where that is 0 or not finite, rounded down to a power of two with
/// power_2_scale.
at::Tensor block_scales(const at::Tensor& x2d, double max, int64_t block_dim, bool power_2_scale);
/// Those scales repeated over their blocks: [rows, cols].
at::Tensor expand_block_scales(const at::Tensor& scale, int64_t rows, int64_t cols,
                               int64_t block_dim);
/// x's FP8 data with current scaling (scale = fp8_max / amax(x) / 2^margin, 1 where amax is 0 or
/// not finite), its transpose as [K, M] when `transpose`, and 1 / scale; of act(x) with `act`.
Fp8Cast fp8_cast(const at::Tensor& x, c10::string_view format, double margin, bool transpose,
                 c10::string_view act);
/// abs_max(x) as [1] float32 (0 for an empty x): what a kernel producing x hands to
/// fp8_cast_with_amax.
at::Tensor amax_of(const at::Tensor& x);
/// fp8_cast with amax(x) given (float32 [1]).
Fp8Cast fp8_cast_with_amax(const at::Tensor& x, c10::string_view format, const at::Tensor& amax,
                           double margin, bool transpose);
/// The same with the given scale [1]; then amax_history and scale are updated as by
/// fp8_quantize_dequantize_delayed (scale_inv is the inverse of the scale the cast used); of
/// act(x) with `act`.
Fp8Cast fp8_cast_delayed(const at::Tensor& x, c10::string_view format,
                         const at::Tensor& amax_history, const at::Tensor& scale, double margin,
                         c10::string_view amax_compute_algo, bool transpose, c10::string_view act);
/// fp8_cast of each group of consecutive rows (sizes) into one data [T, K], the transposes back
/// to back in data_t [T * K], scale_inv [groups]. (fp8_grouped.cpp)
Fp8Cast fp8_cast_grouped(const at::Tensor& x, at::IntArrayRef sizes, c10::string_view format,
                         double margin, bool transpose);
}  // namespace reference

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// fp8.cpp.
namespace fusible::kernels {

/// x cast to FP8 ("e4m3" / "e5m2", current scaling with margin) and back to x's dtype.
at::Tensor fp8_quantize_dequantize(const at::Tensor& x, const std::string& format,
                                   double margin = 0.0);
/// Delayed scaling: x cast with scale [1] and back; amax_history and scale updated in place.
at::Tensor fp8_quantize_dequantize_delayed(const at::Tensor& x, const std::string& format,
                                           const at::Tensor& amax_history, const at::Tensor& scale,
                                           double margin, const std::string& amax_compute_algo);
/// Block scaling: 1x128 (block_dim 1) or 128x128 (2) blocks, each with its own scale.
at::Tensor fp8_quantize_dequantize_block(const at::Tensor& x, const std::string& format,
                                         int64_t block_dim, bool power_2_scale = true);
/// -> (FP8 data, its [K, M] transpose or empty, scale_inv [1]); current scaling. With `act`
/// ("gelu", ...): of act(x), without a tensor of act(x) (an activation's output cast from its
/// input).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast(const at::Tensor& x,
                                                        const std::string& format, double margin,
                                                        bool transpose,
                                                        const std::string& act = "none");
/// fp8_cast with amax(x) given ([1] float32, computed by the kernel that wrote x): no amax pass.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_with_amax(const at::Tensor& x,
                                                                  const std::string& format,
                                                                  const at::Tensor& amax,
                                                                  double margin, bool transpose);
/// fp8_cast with delayed scaling's scale; amax_history and scale updated in place.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_delayed(
    const at::Tensor& x, const std::string& format, const at::Tensor& amax_history,
    const at::Tensor& scale, double margin, const std::string& amax_compute_algo, bool transpose,
    const std::string& act = "none");

/// Current-scaling FP8 data of groups of consecutive rows, each group with its own scale -> (data
/// [T, K], each group's [K, rows_g] transpose at K * its first row of data_t [T * K] (empty
/// unless transpose), scale_inv [groups]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_cast_grouped(const at::Tensor& x,
                                                                at::IntArrayRef sizes,
                                                                const std::string& format,
                                                                double margin, bool transpose);

}  // namespace fusible::kernels

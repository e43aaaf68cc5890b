// Block-scaled FP8 casts as cuBLASLt's block-scaled GEMMs read them (Hopper: VEC128_32F and
// BLK128x128_32F scale modes): FP8 data with one fp32 scale_inv per 1x128 or 128x128 block, in
// the scale layout cuBLASLt expects, and the same for the transpose (the wgrad's operand).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

namespace fusible::kernels {

/// fp8_cast_block's outputs: (data [x's shape], scale_inv, data_t [K, M], scale_inv_t); a part not
/// asked for is empty [0].
using Fp8BlockCast = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

/// The scale_inv layout of an [rows, cols] FP8 matrix whose K (cols) is contiguous, as cuBLASLt's
/// block-scaled GEMMs take it: 1x128 blocks (block_dim 1): [ceil(cols / 128), rows rounded up to
/// 4], entry [kb, r]; 128x128 blocks (block_dim 2): [ceil(rows / 128), ceil(cols / 128) rounded
/// up to 4], entry [rb, kb]. Padding entries are zero.
std::vector<int64_t> block_scale_shape(int64_t rows, int64_t cols, int64_t block_dim);

/// The argument checks of fp8_cast_block.
void check_fp8_cast_block_args(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                               bool rowwise, bool columnwise);

namespace reference {
/// x as [M, K] cast to FP8 in 1x128 (block_dim 1) or 128x128 (block_dim 2) blocks with power-of-two
/// scales (as fp8_quantize_dequantize_block): rowwise, the data and its scale_inv laid out by
/// block_scale_shape(M, K); columnwise, x^T [K, M] cast the same way (1x128 blocks along M; the
/// same 128x128 tiles) with block_scale_shape(K, M). ATen, any device. With `act`, of act(x)
/// (fp8.h's cast_source).
Fp8BlockCast fp8_cast_block(const at::Tensor& x, c10::string_view format, int64_t block_dim,
                            bool rowwise, bool columnwise, c10::string_view act);
/// a [M, K] as the FP8 GEMM sees it: data times its block scale_inv (layout above), in fp32.
at::Tensor dequantize_block(const at::Tensor& data, const at::Tensor& scale_inv, int64_t block_dim);
}  // namespace reference

}  // namespace fusible::kernels

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher (the
// same CPU / CUDA / Meta routing as from Python). Shapes and semantics: the schemas in
// fp8_block.cpp.
namespace fusible::kernels {

/// Block-scaled FP8 cast -> (data, scale_inv, data_t, scale_inv_t) (kernels/fp8/fp8_block.h);
/// with `act` ("gelu", ...), of act(x) without a tensor of it (fp8_cast's act).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_cast_block(
    const at::Tensor& x, const std::string& format, int64_t block_dim, bool rowwise,
    bool columnwise, const std::string& act = "none");

}  // namespace fusible::kernels

// Host launchers of the fp8 family's raw kernels: per-tensor casts (fp8_kernels.cu) and
// block-scaled casts (fp8_block_kernels.cu).
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// y = x cast to FP8 (e4m3, else e5m2) and back, n elements. amax: one float of scratch that
/// receives amax(x) (zeroed here). Current scaling: scale is null and the cast's scale is
/// fmax / amax / 2^margin (1 where amax is 0 or not finite). Delayed scaling: scale [1] is the
/// cast's, and with history [history_len] the history then rolls (newest first) taking amax and
/// scale becomes fmax / (the history's max, or its newest with !use_max) / 2^margin; neither
/// changes where amax is 0 (te's update).
void launch_fp8_qdq(const void* x, void* y, int64_t n, bool e4m3, double margin, float* amax,
                    float* scale, float* history, int64_t history_len, bool use_max,
                    KernelDType dtype, int num_sms, cudaStream_t stream);
/// The tile of launch_fp8_cast's kernels: 128 rows x 64 columns per block.
constexpr int kFp8CastTileRows = 128, kFp8CastTileCols = 64;
/// Tiles (blocks) of launch_fp8_cast over x [rows, cols], rows and cols > 0.
inline int64_t fp8_cast_tiles(int64_t rows, int64_t cols) {
  return (rows + kFp8CastTileRows - 1) / kFp8CastTileRows *
         ((cols + kFp8CastTileCols - 1) / kFp8CastTileCols);
}
/// The one-launch cast's grid over x [rows, cols] (rows and cols > 0) on num_sms SMs: at most a
/// block per SM, so that it fits beside what else runs (a cooperative launch needs all its blocks
/// resident at once); its `partial` scratch holds one float per block.
inline int64_t fp8_cast_one_launch_blocks(int64_t rows, int64_t cols, int num_sms) {
  const int64_t tiles = fp8_cast_tiles(rows, cols);
  return tiles < num_sms ? tiles : num_sms;
}
/// x [rows, cols] cast to FP8 data [rows, cols] and, where data_t is not null, its transpose
/// [cols, rows] (cols, and with data_t rows, multiples of 4; x 16-byte aligned); *scale_inv = 1 /
/// the scale used. Current scaling (scale null): scale from amax(x) as launch_fp8_qdq; with
/// amax_given, *amax already holds amax(x) (the kernel that wrote x computed it) and the cast is
/// one pass. Delayed (scale given): cast with *scale, amax(x) into *amax, then the history and
/// scale update as there. With `act` (16-bit data only), everything above reads act(x) rounded to
/// x's dtype instead of x: the cast of an activation's output, from its input.
/// `partial` (null, or fp8_cast_one_launch_blocks(rows, cols, num_sms) floats of scratch): the
/// whole cast in one cooperative launch, no memset (its amax then stays in the scratch, not
/// *amax), where the device allows and the stream is not being captured (a small tensor's cast
/// costs its launches, not its bytes); else, or with amax_given, the plain launches above.
void launch_fp8_cast(const void* x, void* data, void* data_t, int64_t rows, int64_t cols, bool e4m3,
                     double margin, float* amax, bool amax_given, float* scale, float* scale_inv,
                     float* history, int64_t history_len, bool use_max, KernelDType dtype,
                     int num_sms, cudaStream_t stream, const ActKind* act = nullptr,
                     float* partial = nullptr);
/// Per-tensor current-scaling casts of groups of consecutive rows of x [T, cols], each with the
/// scale of its own amax: group g is rows [row_start[g], row_start[g + 1]) (row_start: num_groups
/// + 1 host values), cast to data [T, cols] and, where data_t is not null, its transpose [cols,
/// rows_g] at data_t + cols * row_start[g]; amax[g] receives the group's amax (zeroed here) and
/// scale_inv[g] 1 / its scale. cols, and with data_t every group's row count, multiples of 4; x
/// 16-byte aligned. One memset and two kernels per 64 groups, whatever their sizes.
void launch_fp8_cast_grouped(const void* x, void* data, void* data_t, const int64_t* row_start,
                             int64_t num_groups, int64_t cols, bool e4m3, double margin,
                             float* amax, float* scale_inv, KernelDType dtype, cudaStream_t stream);
/// Block-scaled FP8 cast (fp8_block_kernels.cu) of x [rows, cols] (16-bit dtype, 16-byte aligned,
/// cols a multiple of 8, and rows too where data_t is given; the last blocks may be partial) in
/// 1x128 (block_dim 1) or 128x128 (2) blocks with power-of-two scales: where not null, data [rows,
/// cols] with scale_inv in block_scale_shape(rows, cols) layout, and data_t [cols, rows] (x^T cast
/// the same way) with scale_inv_t in block_scale_shape(cols, rows) layout (kernels/fp8/fp8_block.h;
/// their padding entries zero). With `act`, of act(x) rounded to x's dtype (launch_fp8_cast).
void launch_fp8_cast_block(const void* x, void* data, float* scale_inv, void* data_t,
                           float* scale_inv_t, int64_t rows, int64_t cols, int64_t block_dim,
                           bool e4m3, KernelDType dtype, cudaStream_t stream,
                           const ActKind* act = nullptr);

}  // namespace fusible::kernels

// Host launchers for the grouped-GEMM kernels (GroupedLinear): rows split into consecutive groups
// whose sizes live on the device. Every kernel reads the group table written by
// launch_group_table, so nothing here needs the sizes on the host.
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// Rows per tile of the row-split kernels (the SIMT GEMM's M tile, the bias gradient's chunk).
constexpr int kGroupTileRows = 64;

/// Most groups the kernels take (grid dimensions y and z).
constexpr int64_t kMaxGroups = 65535;

/// Entries of the int32 group table for `groups` groups: ends[groups] (inclusive prefix sums of the
/// sizes: torch._grouped_mm's offsets), then tile_starts[groups + 1] (each group's first
/// kGroupTileRows-row tile; the last entry is the tile count).
inline int64_t group_table_size(int64_t groups) { return 2 * groups + 1; }
/// An upper bound of the tile count for any split of `rows` rows into `groups` groups.
inline int64_t group_max_tiles(int64_t rows, int64_t groups) {
  return (rows + kGroupTileRows - 1) / kGroupTileRows + groups;
}

/// Checks the split sizes (int32, or int64 when sizes_int64) on the device, before anything reads
/// them: each non-negative and their sum == rows, else a device-side assert naming GroupedLinear
/// (asynchronous; the CUDA context is then unusable, as after any device assert). Writes the table.
void launch_group_table(const void* sizes, bool sizes_int64, int64_t groups, int64_t rows,
                        int32_t* table, cudaStream_t stream);

/// c[r, :] = a[r, :] B_g (+ bias[g, :], times scales[r] when not null) for the rows r of group g
/// (a: [rows, k] with strides (sam, sak); B_g: [k, n] at b + g * sbg with strides (sbk, sbn); c:
/// [rows, n], bias [groups, n] and scales [rows] contiguous; bias may be null). SIMT, fp32 (fp64)
/// accumulation, one rounding: the grouped GEMM where torch._grouped_mm's CUTLASS kernels do not
/// apply.
void launch_grouped_rows_gemm(const void* a, int64_t sam, int64_t sak, const void* b, int64_t sbg,
                              int64_t sbk, int64_t sbn, void* c, int64_t rows, int64_t n, int64_t k,
                              const void* bias, const void* scales, const int32_t* table,
                              int64_t groups, KernelDType dtype, cudaStream_t stream);

/// dw[g] = dy_g^T x_g over the rows of group g (dy: [rows, n], x: [rows, k], dw: [groups, n, k],
/// all contiguous); empty groups get zeros. SIMT, as launch_grouped_rows_gemm.
void launch_grouped_wgrad_gemm(const void* dy, const void* x, void* dw, int64_t rows, int64_t n,
                               int64_t k, const int32_t* table, int64_t groups, KernelDType dtype,
                               cudaStream_t stream);

/// Zeros dw[g] ([per_group] elements each) of every empty group g: the grouped wgrad's rule.
void launch_zero_empty_groups(void* dw, const int32_t* table, int64_t groups, int64_t per_group,
                              KernelDType dtype, cudaStream_t stream);

/// dbias[g, :] = sum over group g's rows of dy[r, :] (times scales[r], in the accumulation type,
/// when not null), in two deterministic passes: per-tile sums into partial ([group_max_tiles,
/// cols], accumulation type), then per-group totals.
void launch_grouped_bias_grad(const void* dy, const void* scales, const int32_t* table,
                              int64_t groups, int64_t rows, int64_t cols, void* partial,
                              void* dbias, KernelDType dtype, cudaStream_t stream);

/// dscales[r] = dy[r, :] . bias[g, :] for the rows r of group g, in the accumulation type.
void launch_grouped_scale_grad(const void* dy, const void* bias, const int32_t* table,
                               int64_t groups, int64_t rows, int64_t cols, void* dscales,
                               KernelDType dtype, int num_sms, cudaStream_t stream);

}  // namespace fusible::kernels

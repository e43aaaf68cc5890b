// What every family's launcher header (<family>/<family>_launchers.h) shares: the stream type, the
// element types and the activation kinds the raw kernels take, and the row chunking of the
// column-sum passes. No torch types, so the .cu files compile with nvcc alone.
#pragma once

#include <algorithm>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace fusible::kernels {

/// Element types the raw kernels are instantiated for.
enum class KernelDType { kFloat32, kFloat64, kFloat16, kBFloat16 };

/// The activation applied elementwise, or to the first half of a gated pair (the activation
/// family's kernels; the bias family's activation-gradient pass).
enum class ActKind { kGelu, kQGelu, kRelu, kSRelu, kSilu, kSigmoid };

/// How many row chunks the column-sum passes (bias and norm-parameter gradients) split rows into:
/// one wave of blocks (each spans up to 256 columns), given how many fit on an SM at once.
inline int64_t column_sum_chunks(int64_t rows, int64_t cols, int num_sms, int blocks_per_sm = 8) {
  // Rounding down: one block past a full wave costs a whole extra wave (the GELU backward's
  // 53-register blocks fit 4 per SM: 17 chunks of 64 column blocks made 2.06 waves, run as 3);
  // each chunk at least 64 rows.
  const int64_t col_blocks = (cols + 255) / 256;
  const int64_t want = std::max<int64_t>(1, int64_t{blocks_per_sm} * num_sms / col_blocks);
  const int64_t max_by_rows = std::max<int64_t>(1, rows / 64);
  return std::min(want, max_by_rows);
}

}  // namespace fusible::kernels

// Host launchers of the loss family's raw kernels (loss_kernels.cu): one block per row of logits
// [rows, classes] (contiguous); targets int64; loss, stats [rows, 2] (max, log sum exp(x - max))
// and dloss in the accumulation type (fp32; fp64 for fp64 logits).
#pragma once

#include <cstdint>

#include "kernels/common/launcher_types.h"

namespace fusible::kernels {

/// loss[r] = (max - logits[r, targets[r]]) + log-sum (0 where targets[r] == ignore_index, NaN
/// where it is outside [0, classes)), stats[r] = (max, log-sum).
void launch_cross_entropy_fwd(const void* logits, const int64_t* targets, void* loss, void* stats,
                              int64_t rows, int64_t classes, int64_t ignore_index,
                              KernelDType dtype, cudaStream_t stream);
/// dlogits[r] = (softmax(logits[r]) - onehot(targets[r])) * dloss[r], 0 on ignored rows.
void launch_cross_entropy_bwd(const void* dloss, const void* logits, const int64_t* targets,
                              const void* stats, void* dlogits, int64_t rows, int64_t classes,
                              int64_t ignore_index, KernelDType dtype, cudaStream_t stream);

}  // namespace fusible::kernels

// cross_entropy_fwd / cross_entropy_bwd: softmax cross-entropy over the last dim, read from the
// logits in their own dtype (no float32 copy) and differentiated without storing the softmax.
// Argument checks shared by the ATen reference (CPU, Meta) and the CUDA kernels' wrappers.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace fusible::kernels::reference {

/// logits [rows, classes] floating; targets [rows] int64 on logits' device.
void check_cross_entropy_fwd_args(const at::Tensor& logits, const at::Tensor& targets);
/// dloss [rows] and stats [rows, 2] float32 (float64 for float64 logits); the rest as the
/// forward's.
void check_cross_entropy_bwd_args(const at::Tensor& dloss, const at::Tensor& logits,
                                  const at::Tensor& targets, const at::Tensor& stats);

}  // namespace fusible::kernels::reference

// ---- Entry points: torch.ops.fusible.<name> for C++ callers, through the dispatcher. Shapes and
// semantics: the schemas in loss.cpp.
namespace fusible::kernels {

/// -> (loss [rows], stats [rows, 2]) in float32 (float64 for float64): stats[r] = (max of row r,
/// log sum exp(logits[r] - max)), loss = max + log-sum - logits[target] (0 where target ==
/// ignore_index), summed in the order that keeps it exact for large logits.
std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits,
                                                     const at::Tensor& targets,
                                                     int64_t ignore_index);
/// dlogits = (softmax(logits) - onehot(target)) * dloss[row], in logits' dtype; 0 on ignored rows.
at::Tensor cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits,
                             const at::Tensor& targets, const at::Tensor& stats,
                             int64_t ignore_index);

}  // namespace fusible::kernels

// Softmax cross-entropy: argument checks and the ATen reference (CPU, Meta), computed in fp32
// (fp64 for fp64). CUDA: loss_cuda.cpp.
#include "kernels/loss/loss.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/log.h>
#include <ATen/ops/masked_select.h>
#include <ATen/ops/max.h>
#include <ATen/ops/scatter.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

void check_cross_entropy_fwd_args(const at::Tensor& logits, const at::Tensor& targets) {
  const char* op = "cross_entropy_fwd";
  FUSIBLE_CHECK_FLOATING(op, "logits", logits);
  FUSIBLE_CHECK_DIM(op, "logits", logits, 2);
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kLong, op,
                   ": expected targets to be an int64 tensor, got ", targets.scalar_type());
  FUSIBLE_CHECK_DIM(op, "targets", targets, 1);
  FUSIBLE_CHECK_SAME_DEVICE(op, "logits", logits, "targets", targets);
  TORCH_CHECK(targets.sym_size(0) == logits.sym_size(0), op, ": expected ", logits.sym_size(0),
              " targets (one per row of logits), got ", targets.sym_size(0));
}

void check_cross_entropy_bwd_args(const at::Tensor& dloss, const at::Tensor& logits,
                                  const at::Tensor& targets, const at::Tensor& stats) {
  const char* op = "cross_entropy_bwd";
  check_cross_entropy_fwd_args(logits, targets);
  const auto acc = acc_dtype(logits.scalar_type());
  const auto rows = logits.sym_size(0);
  TORCH_CHECK(dloss.scalar_type() == acc && dloss.dim() == 1 && dloss.sym_size(0) == rows, op,
              ": expected dloss of dtype ", acc, " and shape [", rows, "], got ",
              dloss.scalar_type(), " of shape ", dloss.sym_sizes());
  TORCH_CHECK(stats.scalar_type() == acc && stats.dim() == 2 && stats.sym_size(0) == rows &&
                  stats.sym_size(1) == 2,
              op, ": expected stats of dtype ", acc, " and shape [", rows, ", 2], got ",
              stats.scalar_type(), " of shape ", stats.sym_sizes());
  FUSIBLE_CHECK_SAME_DEVICE(op, "logits", logits, "dloss", dloss);
  FUSIBLE_CHECK_SAME_DEVICE(op, "logits", logits, "stats", stats);
}

}  // namespace reference

// The implementations registered under CompositeExplicitAutograd (named: the entry points below
// have the same names).
namespace composite {
namespace {

// Targets with the ignored ones replaced by class 0 (their rows are masked afterwards); a target
// outside [0, classes) was refused (CPU) before.
at::Tensor safe_targets(const at::Tensor& targets, const at::Tensor& ignored) {
  return at::where(ignored, at::zeros_like(targets), targets);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits,
                                                     const at::Tensor& targets,
                                                     int64_t ignore_index) {
  reference::check_cross_entropy_fwd_args(logits, targets);
  const auto ignored = targets == ignore_index;
  if (targets.device().is_cpu()) {  // values are known here without a device sync
    const auto bad = (ignored.logical_not() & ((targets < 0) | (targets >= logits.size(1))));
    TORCH_CHECK_INDEX(!bad.any().item<bool>(), "cross_entropy_fwd: expected targets in [0, ",
                      logits.size(1), ") or ignore_index (", ignore_index, "), got ",
                      targets.masked_select(bad)[0].item<int64_t>());
  }
  const auto x = upcast(logits);
  const auto top = std::get<0>(at::max(x, 1, /*keepdim=*/true));
  const auto log_sum = at::log(at::exp(x - top).sum(1));
  const auto picked = at::gather(x, 1, safe_targets(targets, ignored).unsqueeze(1)).squeeze(1);
  const auto row_max = top.squeeze(1);
  // (max - picked) + log-sum: exact for large logits, where (max + log-sum) - picked cancels.
  const auto loss = at::where(ignored, at::zeros_like(row_max), (row_max - picked) + log_sum);
  return {loss, at::stack({row_max, log_sum}, 1)};
}

at::Tensor cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits,
                             const at::Tensor& targets, const at::Tensor& stats,
                             int64_t ignore_index) {
  reference::check_cross_entropy_bwd_args(dloss, logits, targets, stats);
  const auto x = upcast(logits);
  const auto ignored = targets == ignore_index;
  const auto onehot =
      at::scatter(at::zeros_like(x), 1, safe_targets(targets, ignored).unsqueeze(1), 1.0);
  const auto scale = at::where(ignored, at::zeros_like(dloss), dloss).unsqueeze(1);
  const auto softmax =
      at::exp((x - stats.select(1, 0).unsqueeze(1)) - stats.select(1, 1).unsqueeze(1));
  return ((softmax - onehot) * scale).to(logits.scalar_type());
}

}  // namespace composite

// ---- Entry points for C++ callers (declared in loss.h).

std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits,
                                                     const at::Tensor& targets,
                                                     int64_t ignore_index) {
  FUSIBLE_DISPATCH(cross_entropy_fwd, logits, targets, ignore_index);
}
at::Tensor cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits,
                             const at::Tensor& targets, const at::Tensor& stats,
                             int64_t ignore_index) {
  FUSIBLE_DISPATCH(cross_entropy_bwd, dloss, logits, targets, stats, ignore_index);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // logits [rows, classes], targets [rows] int64 -> (loss [rows], stats [rows, 2]), float32
  // (float64 for float64 logits): stats[r] = (max_c logits[r, c], log sum_c exp(logits[r, c] -
  // max)), loss = logsumexp - logits[r, target], 0 where target == ignore_index. A target outside
  // [0, classes) raises on CPU and gives a NaN loss on CUDA.
  define(m,
         "cross_entropy_fwd(Tensor logits, Tensor targets, int ignore_index=-100) -> "
         "(Tensor, Tensor)");
  // dlogits = (softmax(logits) - onehot(target)) * dloss[row] in logits' dtype, 0 on ignored rows.
  define(m,
         "cross_entropy_bwd(Tensor dloss, Tensor logits, Tensor targets, Tensor stats, "
         "int ignore_index=-100) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("cross_entropy_fwd", &composite::cross_entropy_fwd);
  m.impl("cross_entropy_bwd", &composite::cross_entropy_bwd);
}

}  // namespace fusible::kernels

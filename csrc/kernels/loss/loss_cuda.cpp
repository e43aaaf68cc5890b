// cross_entropy_fwd / cross_entropy_bwd on CUDA: torch-facing wrappers around loss_kernels.cu.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/loss/loss.h"
#include "kernels/loss/loss_launchers.h"

namespace fusible::kernels {
namespace {

// One block per row: the grid's x size caps the rows (a larger count would wrap and leave rows
// unwritten).
void check_rows(const char* op, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": expected at most ",
              std::numeric_limits<int32_t>::max(), " rows of logits on CUDA, got ", rows,
              " (split the batch)");
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_cuda(const at::Tensor& logits,
                                                          const at::Tensor& targets,
                                                          int64_t ignore_index) {
  reference::check_cross_entropy_fwd_args(logits, targets);
  check_rows("cross_entropy_fwd", logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto x = logits.contiguous(), t = targets.contiguous();
  const auto acc = x.options().dtype(acc_dtype(x.scalar_type()));
  auto loss = at::empty({x.size(0)}, acc), stats = at::empty({x.size(0), 2}, acc);
  launch_cross_entropy_fwd(x.const_data_ptr(), t.const_data_ptr<int64_t>(), loss.mutable_data_ptr(),
                           stats.mutable_data_ptr(), x.size(0), x.size(1), ignore_index,
                           kernel_dtype("cross_entropy_fwd", x), c10::cuda::getCurrentCUDAStream());
  return {loss, stats};
}

at::Tensor cross_entropy_bwd_cuda(const at::Tensor& dloss, const at::Tensor& logits,
                                  const at::Tensor& targets, const at::Tensor& stats,
                                  int64_t ignore_index) {
  reference::check_cross_entropy_bwd_args(dloss, logits, targets, stats);
  check_rows("cross_entropy_bwd", logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto x = logits.contiguous(), t = targets.contiguous();
  const auto g = dloss.contiguous(), st = stats.contiguous();
  auto dx = at::empty(x.sizes(), x.options());
  launch_cross_entropy_bwd(g.const_data_ptr(), x.const_data_ptr(), t.const_data_ptr<int64_t>(),
                           st.const_data_ptr(), dx.mutable_data_ptr(), x.size(0), x.size(1),
                           ignore_index, kernel_dtype("cross_entropy_bwd", x),
                           c10::cuda::getCurrentCUDAStream());
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("cross_entropy_fwd", &cross_entropy_fwd_cuda);
  m.impl("cross_entropy_bwd", &cross_entropy_bwd_cuda);
}

}  // namespace fusible::kernels

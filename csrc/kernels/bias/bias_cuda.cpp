// bias_fwd / bias_bwd / bias_act_bwd on CUDA: torch-facing wrappers around bias_kernels.cu.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/activation/activation.h"
#include "kernels/bias/bias.h"
#include "kernels/bias/bias_launchers.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"
#include "kernels/linear/linear.h"

namespace fusible::kernels {
namespace {

at::Tensor bias_fwd_cuda(const at::Tensor& x, const at::Tensor& bias) {
  check_bias_fwd_args(x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto bc = bias.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  launch_bias_fwd(xc.const_data_ptr(), bc.const_data_ptr(), y.mutable_data_ptr(), rows, cols,
                  kernel_dtype("bias_fwd", x), current_sm_count(),
                  c10::cuda::getCurrentCUDAStream());
  return y;
}

// The bias gradient of dy (contiguous), after the activation's gradient when pre is given: then
// dpre (which may be dy itself) receives dy * act'(pre).
at::Tensor bias_grad(const char* op, const at::Tensor& dy, const at::Tensor& pre,
                     const at::Tensor& dpre, ActKind act, const at::Tensor& amax = {}) {
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t cols = dy.size(-1);
  const int64_t rows = cols == 0 ? 0 : dy.numel() / cols;
  const auto dtype = kernel_dtype(op, dy);
  const int64_t chunks = column_sum_chunks(rows, cols, current_sm_count(),
                                           bias_grad_blocks_per_sm(pre.defined(), dtype));
  const auto workspace = column_sum_workspace(chunks, cols, dy);
  auto dbias = at::empty({cols}, dy.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (pre.defined()) {
    launch_bias_act_bwd(dy.const_data_ptr(), pre.const_data_ptr(), dpre.mutable_data_ptr(),
                        data_or_null(workspace), dbias.mutable_data_ptr(),
                        amax.defined() ? amax.mutable_data_ptr<float>() : nullptr, rows, cols,
                        chunks, act, dtype, stream);
  } else {
    launch_bias_bwd(dy.const_data_ptr(), data_or_null(workspace), dbias.mutable_data_ptr(), rows,
                    cols, chunks, dtype, stream);
  }
  return dbias;
}

at::Tensor bias_bwd_cuda(const at::Tensor& dy) {
  check_bias_bwd_args(dy);
  return bias_grad("bias_bwd", dy.contiguous(), {}, {}, ActKind::kRelu);
}

// The bias + activation backward ops' argument checks (in place: dy of pre's dtype too).
void check_bias_act_args(const char* op, const at::Tensor& dy, const at::Tensor& pre,
                         c10::string_view act, bool in_place) {
  reference::check_epilogue_act(op, act);
  FUSIBLE_CHECK_FLOATING(op, "pre", pre);
  FUSIBLE_CHECK_MIN_DIM(op, "pre", pre, 1);
  FUSIBLE_CHECK_SHAPE_LIKE(op, "dy", dy, pre);
  FUSIBLE_CHECK_SAME_DEVICE(op, "dy", dy, "pre", pre);
  if (in_place) FUSIBLE_CHECK_SAME_DTYPE(op, "dy", dy, "pre", pre);
}

// -> (dpre, dbias, and with_amax max |dpre| from the same pass, for an FP8 cast of dpre).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act(const char* op, const at::Tensor& dy,
                                                        const at::Tensor& pre, c10::string_view act,
                                                        bool with_amax) {
  check_bias_act_args(op, dy, pre, act, /*in_place=*/false);
  auto dpre = at::empty(pre.sizes(), pre.options());
  auto amax = with_amax ? zeroed_amax(pre.device()) : at::Tensor();
  auto dbias = bias_grad(op, dy.to(pre.scalar_type()).contiguous(), pre.contiguous(), dpre,
                         reference::parse_activation(op, act), amax);
  return {dpre, dbias, amax};
}

// bias_act in place: dy becomes dpre -> (dbias, amax).
std::pair<at::Tensor, at::Tensor> bias_act_in_place(const char* op, const at::Tensor& dy,
                                                    const at::Tensor& pre, c10::string_view act,
                                                    bool with_amax) {
  check_bias_act_args(op, dy, pre, act, /*in_place=*/true);
  if (!dy.is_contiguous()) {  // the kernel writes rows in place: through a copy
    auto [dpre, dbias, amax] = bias_act(op, dy, pre, act, with_amax);
    dy.copy_(dpre);
    return {dbias, amax};
  }
  auto amax = with_amax ? zeroed_amax(dy.device()) : at::Tensor();
  auto dbias = bias_grad(op, dy, pre.contiguous(), dy, reference::parse_activation(op, act), amax);
  return {dbias, amax};
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_cuda(const at::Tensor& dy, const at::Tensor& pre,
                                                     c10::string_view act) {
  auto [dpre, dbias, unused] = bias_act("bias_act_bwd", dy, pre, act, false);
  return {dpre, dbias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_amax_cuda(const at::Tensor& dy,
                                                                      const at::Tensor& pre,
                                                                      c10::string_view act) {
  return bias_act("bias_act_bwd_amax", dy, pre, act, true);
}

at::Tensor bias_act_bwd__cuda(const at::Tensor& dy, const at::Tensor& pre, c10::string_view act) {
  return bias_act_in_place("bias_act_bwd_", dy, pre, act, false).first;
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_amax__cuda(const at::Tensor& dy,
                                                           const at::Tensor& pre,
                                                           c10::string_view act) {
  return bias_act_in_place("bias_act_bwd_amax_", dy, pre, act, true);
}

}  // namespace

at::Tensor bias_act_bwd_in_place(const at::Tensor& dz, const at::Tensor& pre,
                                 c10::string_view act) {
  TORCH_INTERNAL_ASSERT(dz.is_contiguous() && pre.is_contiguous() &&
                        dz.scalar_type() == pre.scalar_type() && dz.sizes().equals(pre.sizes()));
  return bias_grad("bias_act_bwd", dz, pre, dz, reference::parse_activation("bias_act_bwd", act));
}

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("bias_fwd", &bias_fwd_cuda);
  m.impl("bias_bwd", &bias_bwd_cuda);
  m.impl("bias_act_bwd", &bias_act_bwd_cuda);
  m.impl("bias_act_bwd_", &bias_act_bwd__cuda);
  m.impl("bias_act_bwd_amax", &bias_act_bwd_amax_cuda);
  m.impl("bias_act_bwd_amax_", &bias_act_bwd_amax__cuda);
}

}  // namespace fusible::kernels

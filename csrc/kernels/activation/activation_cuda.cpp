// The activation family on CUDA: torch-facing wrappers around activation_kernels.cu (one kernel per
// op, fp32 math in registers; the scaled GLUs' backward adds a row-sum kernel for dscales).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/activation/activation.h"
#include "kernels/activation/activation_launchers.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/common/cuda_device.h"
#include "kernels/common/cuda_dtype.h"

namespace fusible::kernels {
namespace {

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

at::Tensor activation_fwd_cuda(const at::Tensor& x, c10::string_view kind) {
  FUSIBLE_CHECK_FLOATING("activation_fwd", "x", x);
  const auto act = reference::parse_activation("activation_fwd", kind);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  auto y = at::empty(x.sizes(), x.options());
  launch_activation_fwd(xc.const_data_ptr(), y.mutable_data_ptr(), x.numel(), act,
                        kernel_dtype("activation_fwd", x), current_sm_count(), stream());
  return y;
}

at::Tensor activation_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, c10::string_view kind) {
  FUSIBLE_CHECK_FLOATING("activation_bwd", "x", x);
  FUSIBLE_CHECK_SHAPE_LIKE("activation_bwd", "dy", dy, x);
  FUSIBLE_CHECK_SAME_DEVICE("activation_bwd", "dy", dy, "x", x);
  const auto act = reference::parse_activation("activation_bwd", kind);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dyc = dy.to(x.scalar_type()).contiguous(), xc = x.contiguous();
  auto dx = at::empty(x.sizes(), x.options());
  launch_activation_bwd(dyc.const_data_ptr(), xc.const_data_ptr(), dx.mutable_data_ptr(), x.numel(),
                        act, kernel_dtype("activation_bwd", x), current_sm_count(), stream());
  return dx;
}

std::vector<int64_t> half_shape(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  shape.back() /= 2;
  return shape;
}

// Rows (x's leading dims) and half-width of x [..., 2h].
std::pair<int64_t, int64_t> glu_dims(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return {rows, x.size(-1) / 2};
}

// Per-row scales in the accumulation dtype, as the kernels read them.
at::Tensor acc_scales(const at::Tensor& scales, const at::Tensor& x) {
  return scales.defined() ? scales.to(acc_dtype(x.scalar_type())).contiguous() : at::Tensor();
}

at::Tensor glu_fwd_impl(const char* op, const at::Tensor& x, const GluParams& p,
                        const at::Tensor& scales) {
  reference::check_glu_input(op, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  const auto sc = acc_scales(scales, x);
  auto y = at::empty(half_shape(x), x.options());
  const auto [rows, h] = glu_dims(x);
  launch_glu_fwd(xc.const_data_ptr(), y.mutable_data_ptr(), rows, h, p,
                 sc.defined() ? sc.const_data_ptr() : nullptr, kernel_dtype(op, x),
                 current_sm_count(), stream());
  return y;
}

// dx; with dscales (ScaledSwiGLU), also the scales' gradient (in the accumulation dtype) from the
// same prepared operands.
// With y (a scaled GLU only), also the forward's output from the same pass.
at::Tensor glu_bwd_impl(const char* op, const at::Tensor& dy, const at::Tensor& x,
                        const GluParams& p, const at::Tensor& scales, at::Tensor* dscales = nullptr,
                        at::Tensor* y = nullptr) {
  reference::check_glu_input(op, x);
  reference::check_glu_grad(op, dy, x);
  const auto [rows, h] = glu_dims(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dyc = dy.to(x.scalar_type()).contiguous(), xc = x.contiguous();
  const auto sc = acc_scales(scales, x);
  auto dx = at::empty(x.sizes(), x.options());
  if (dscales) {  // one pass for both
    *dscales = at::empty(scales.sizes(), scales.options().dtype(acc_dtype(x.scalar_type())));
    if (y) *y = at::empty(dy.sizes(), x.options());
    launch_scaled_glu_bwd(dyc.const_data_ptr(), xc.const_data_ptr(), dx.mutable_data_ptr(),
                          dscales->mutable_data_ptr(), y ? y->mutable_data_ptr() : nullptr, rows, h,
                          p, sc.const_data_ptr(), kernel_dtype(op, x), current_sm_count(),
                          stream());
    return dx;
  }
  launch_glu_bwd(dyc.const_data_ptr(), xc.const_data_ptr(), dx.mutable_data_ptr(), rows, h, p,
                 sc.defined() ? sc.const_data_ptr() : nullptr, kernel_dtype(op, x),
                 current_sm_count(), stream());
  return dx;
}

GluParams gated(const char* op, c10::string_view kind) {
  GluParams p;
  p.act = reference::parse_gated(op, kind);
  return p;
}

GluParams clamped(const char* op, double limit, double alpha, double offset) {
  reference::check_clamped_params(op, limit, alpha, offset);
  GluParams p;
  p.mode = GluMode::kClamped;
  p.limit = limit;
  p.alpha = alpha;
  p.offset = offset;
  return p;
}

GluParams situ(const char* op, double beta1, double beta2) {
  reference::check_situ_params(op, beta1, beta2);
  GluParams p;
  p.mode = GluMode::kSitu;
  p.beta1 = beta1;
  p.beta2 = beta2;
  return p;
}

at::Tensor glu_fwd_cuda(const at::Tensor& x, c10::string_view kind) {
  return glu_fwd_impl("glu_fwd", x, gated("glu_fwd", kind), {});
}

at::Tensor glu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, c10::string_view kind) {
  return glu_bwd_impl("glu_bwd", dy, x, gated("glu_bwd", kind), {});
}

at::Tensor clamped_swiglu_fwd_cuda(const at::Tensor& x, double limit, double alpha, double offset) {
  return glu_fwd_impl("clamped_swiglu_fwd", x, clamped("clamped_swiglu_fwd", limit, alpha, offset),
                      {});
}

at::Tensor clamped_swiglu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, double limit,
                                   double alpha, double offset) {
  return glu_bwd_impl("clamped_swiglu_bwd", dy, x,
                      clamped("clamped_swiglu_bwd", limit, alpha, offset), {});
}

at::Tensor situglu_fwd_cuda(const at::Tensor& x, double beta1, double beta2) {
  return glu_fwd_impl("situglu_fwd", x, situ("situglu_fwd", beta1, beta2), {});
}

at::Tensor situglu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, double beta1, double beta2) {
  return glu_bwd_impl("situglu_bwd", dy, x, situ("situglu_bwd", beta1, beta2), {});
}

at::Tensor scaled_fwd(const char* op, const at::Tensor& x, const at::Tensor& scales,
                      const GluParams& p) {
  reference::check_scales(op, x, scales);
  return glu_fwd_impl(op, x, p, scales);
}

std::tuple<at::Tensor, at::Tensor> scaled_bwd(const char* op, const at::Tensor& dy,
                                              const at::Tensor& x, const at::Tensor& scales,
                                              const GluParams& p) {
  reference::check_scales(op, x, scales);
  at::Tensor dscales;
  auto dx = glu_bwd_impl(op, dy, x, p, scales, &dscales);
  return {dx, dscales.to(scales.scalar_type())};
}

at::Tensor scaled_swiglu_fwd_cuda(const at::Tensor& x, const at::Tensor& scales) {
  return scaled_fwd("scaled_swiglu_fwd", x, scales, GluParams{});
}

std::tuple<at::Tensor, at::Tensor> scaled_swiglu_bwd_cuda(const at::Tensor& dy, const at::Tensor& x,
                                                          const at::Tensor& scales) {
  return scaled_bwd("scaled_swiglu_bwd", dy, x, scales, GluParams{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> scaled_swiglu_bwd_fwd_cuda(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scales) {
  constexpr const char* op = "scaled_swiglu_bwd_fwd";
  reference::check_scales(op, x, scales);
  at::Tensor dscales, y;
  auto dx = glu_bwd_impl(op, dy, x, GluParams{}, scales, &dscales, &y);
  return {dx, dscales.to(scales.scalar_type()), y};
}

at::Tensor scaled_situglu_fwd_cuda(const at::Tensor& x, const at::Tensor& scales, double beta1,
                                   double beta2) {
  return scaled_fwd("scaled_situglu_fwd", x, scales, situ("scaled_situglu_fwd", beta1, beta2));
}

std::tuple<at::Tensor, at::Tensor> scaled_situglu_bwd_cuda(const at::Tensor& dy,
                                                           const at::Tensor& x,
                                                           const at::Tensor& scales, double beta1,
                                                           double beta2) {
  return scaled_bwd("scaled_situglu_bwd", dy, x, scales, situ("scaled_situglu_bwd", beta1, beta2));
}

at::Tensor scaled_clamped_swiglu_fwd_cuda(const at::Tensor& x, const at::Tensor& scales,
                                          double limit, double alpha, double offset) {
  return scaled_fwd("scaled_clamped_swiglu_fwd", x, scales,
                    clamped("scaled_clamped_swiglu_fwd", limit, alpha, offset));
}

std::tuple<at::Tensor, at::Tensor> scaled_clamped_swiglu_bwd_cuda(const at::Tensor& dy,
                                                                  const at::Tensor& x,
                                                                  const at::Tensor& scales,
                                                                  double limit, double alpha,
                                                                  double offset) {
  return scaled_bwd("scaled_clamped_swiglu_bwd", dy, x, scales,
                    clamped("scaled_clamped_swiglu_bwd", limit, alpha, offset));
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("activation_fwd", &activation_fwd_cuda);
  m.impl("activation_bwd", &activation_bwd_cuda);
  m.impl("glu_fwd", &glu_fwd_cuda);
  m.impl("glu_bwd", &glu_bwd_cuda);
  m.impl("clamped_swiglu_fwd", &clamped_swiglu_fwd_cuda);
  m.impl("clamped_swiglu_bwd", &clamped_swiglu_bwd_cuda);
  m.impl("scaled_swiglu_fwd", &scaled_swiglu_fwd_cuda);
  m.impl("scaled_swiglu_bwd", &scaled_swiglu_bwd_cuda);
  m.impl("scaled_swiglu_bwd_fwd", &scaled_swiglu_bwd_fwd_cuda);
  m.impl("situglu_fwd", &situglu_fwd_cuda);
  m.impl("situglu_bwd", &situglu_bwd_cuda);
  m.impl("scaled_situglu_fwd", &scaled_situglu_fwd_cuda);
  m.impl("scaled_situglu_bwd", &scaled_situglu_bwd_cuda);
  m.impl("scaled_clamped_swiglu_fwd", &scaled_clamped_swiglu_fwd_cuda);
  m.impl("scaled_clamped_swiglu_bwd", &scaled_clamped_swiglu_bwd_cuda);
}

}  // namespace fusible::kernels

// fp8_gemm on CUDA: one cuBLASLt FP8 GEMM with the scales, bias, residual (beta = 1) and GELU /
// ReLU epilogues. An epilogue cuBLASLt lacks for FP8 here runs as the plain GEMM and our activation
// kernel; what cuBLASLt cannot take at all (unaligned rows, K not a multiple of 16, fp32 output
// with a bias) runs the reference.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#include "kernels/dispatch.h"
#include "kernels/fp8/fp8_gemm.h"
#include "kernels/gemm/cublaslt_gemm.h"
#include "kernels/gemm/row_views.h"

namespace fusible::kernels {
namespace {

using gemm::Epilogue;

// A scale_inv as cuBLASLt takes it: 16-byte aligned (a view at another offset, say one group's
// entry of a grouped cast's, is copied; 4 bytes per tensor, block scales a few more).
at::Tensor aligned_scale(const at::Tensor& s) {
  return reinterpret_cast<std::uintptr_t>(s.const_data_ptr()) % 16 == 0 ? s : s.clone();
}

// The cuBLASLt GEMM alpha * a b^T (+ bias) of fp8_gemm's operands; the caller sets d (and any
// other epilogue or C).
gemm::RowMajorGemm fp8_gemm_of(const at::Tensor& a, const at::Tensor& a_scale_inv,
                               const at::Tensor& b, const at::Tensor& b_scale_inv,
                               const std::optional<at::Tensor>& bias, double alpha, bool fast_accum,
                               int64_t a_block, int64_t b_block) {
  gemm::RowMajorGemm g;
  g.a = gemm::rows(a);
  g.b = b.contiguous();
  g.trans_b = true;
  g.a_scale_inv = aligned_scale(a_scale_inv);
  g.b_scale_inv = aligned_scale(b_scale_inv);
  g.a_block = a_block;
  g.b_block = b_block;
  g.fast_accum = fast_accum && a_block == 0;  // block-scaled GEMMs take no fast accumulation
  g.alpha = alpha;
  if (bias) {
    g.epilogue = Epilogue::kBias;
    g.bias = bias->contiguous();
  }
  return g;
}

std::tuple<at::Tensor, at::Tensor> fp8_gemm_cuda(
    const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
    const at::Tensor& b_scale_inv, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& other, double alpha, c10::string_view act, bool save_pre,
    bool fast_accum, int64_t a_block, int64_t b_block) {
  check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, act, save_pre,
                      a_block, b_block);
  const auto fallback = [&] {
    return reference::fp8_gemm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, alpha, act,
                               save_pre, fast_accum, a_block, b_block);
  };
  auto g = fp8_gemm_of(a, a_scale_inv, b, b_scale_inv, bias, alpha, fast_accum, a_block, b_block);
  g.d = at::empty({g.a.size(0), b.size(0)}, a.options().dtype(out_dtype));
  if (other) {
    g.c = gemm::rows(*other);
    g.beta = 1.0;
  }
  const auto empty = at::empty({0}, g.d.options());
  if (act == "none" || !bias) {
    if (!gemm::can_run(g) || !gemm::try_run(g)) return fallback();
    auto d = gemm::shaped_like(g.d, a);
    if (act == "none") return {d, empty};
    return {activation_fwd(d, std::string(act)), save_pre ? d : empty};
  }
  // The activation in the epilogue: GELU keeping its input for the backward, or not; ReLU (its
  // backward needs only the output).
  const auto plain = g;
  if (act == "gelu") {
    g.epilogue = save_pre ? Epilogue::kGeluAuxBias : Epilogue::kGeluBias;
    if (save_pre) g.aux = at::empty_like(g.d);
  } else if (!save_pre) {
    g.epilogue = Epilogue::kReluBias;
  }
  if (g.epilogue != Epilogue::kBias && gemm::can_run(g) && gemm::try_run(g)) {
    return {gemm::shaped_like(g.d, a), save_pre ? gemm::shaped_like(g.aux, a) : empty};
  }
  if (!gemm::can_run(plain) || !gemm::try_run(plain)) return fallback();
  auto pre = gemm::shaped_like(plain.d, a);
  return {activation_fwd(pre, std::string(act)), save_pre ? pre : empty};
}

void fp8_gemm_out_cuda(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                       const at::Tensor& b_scale_inv, const at::Tensor& out,
                       const std::optional<at::Tensor>& bias, double alpha, bool fast_accum,
                       int64_t a_block, int64_t b_block, bool accumulate) {
  check_fp8_gemm_out_args(a, a_scale_inv, b, b_scale_inv, out, bias, a_block, b_block);
  auto g = fp8_gemm_of(a, a_scale_inv, b, b_scale_inv, bias, alpha, fast_accum, a_block, b_block);
  // cuBLASLt writes out itself where it is one contiguous [M, N] block; else via a copy. To
  // accumulate, out is C too (beta = 1): in place for an fp32 out; a 16-bit D aliasing C would
  // have the product rounded before the add, so such an out is C alone and D is copied back.
  const bool wide = out.scalar_type() == at::kFloat;
  if (out.is_contiguous()) {
    const auto view = out.view({g.a.size(0), b.size(0)});
    g.d = !accumulate || wide ? view : at::empty(view.sizes(), view.options());
    if (accumulate) {
      g.c = view;
      g.beta = 1.0;
    }
  }
  if (g.d.defined() && gemm::can_run(g) && gemm::try_run(g)) {
    if (accumulate && !wide) out.view({g.a.size(0), b.size(0)}).copy_(g.d);
    return;
  }
  if (accumulate)
    return reference::fp8_gemm_out(a, a_scale_inv, b, b_scale_inv, out, bias, alpha, fast_accum,
                                   a_block, b_block, true);
  out.copy_(
      std::get<0>(fp8_gemm_cuda(a, a_scale_inv, b, b_scale_inv, out.scalar_type(), bias,
                                std::nullopt, alpha, "none", false, fast_accum, a_block, b_block)));
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  m.impl("fp8_gemm", &fp8_gemm_cuda);
  m.impl("fp8_gemm_out", &fp8_gemm_out_cuda);
}

}  // namespace fusible::kernels

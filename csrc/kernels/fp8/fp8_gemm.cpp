// fp8_gemm: checks, the reference (CPU; the CUDA fallback) and Meta.
#include "kernels/fp8/fp8_gemm.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/dispatch.h"
#include "kernels/fp8/fp8_block.h"
#include "kernels/linear/linear.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {

bool is_fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

void check_fp8_gemm_args(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                         const at::Tensor& b_scale_inv, at::ScalarType out_dtype,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, c10::string_view act,
                         bool save_pre, int64_t a_block, int64_t b_block, const char* op) {
  TORCH_CHECK_VALUE(is_fp8(a) && is_fp8(b), op,
                    ": expected a and b of dtype float8_e4m3fn or float8_e5m2, got ",
                    a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_VALUE(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
                    op, ": a and b cannot both be float8_e5m2 (no E5M2 x E5M2 FP8 GEMM)");
  FUSIBLE_CHECK_MIN_DIM(op, "a", a, 1);
  FUSIBLE_CHECK_DIM(op, "b", b, 2);
  TORCH_CHECK(a.sym_size(-1) == b.sym_size(1), op, ": expected a.size(-1) == b.size(1) (K), got ",
              a.sym_size(-1), " and ", b.sym_size(1));
  FUSIBLE_CHECK_SAME_DEVICE(op, "a", a, "b", b);
  for (const auto& [name, s] :
       {std::pair<const char*, const at::Tensor*>{"a_scale_inv", &a_scale_inv},
        {"b_scale_inv", &b_scale_inv}}) {
    TORCH_CHECK_VALUE(s->scalar_type() == at::kFloat, op, ": expected a float32 ", name, ", got ",
                      s->scalar_type());
    FUSIBLE_CHECK_SAME_DEVICE(op, "a", a, name, (*s));
  }
  TORCH_CHECK_VALUE(a_block >= 0 && a_block <= 2 && b_block >= 0 && b_block <= 2 &&
                        (a_block == 0) == (b_block == 0) && !(a_block == 2 && b_block == 2),
                    op,
                    ": expected a_block and b_block both 0 (per-tensor scales) or both block "
                    "scales (1: 1x128, 2: 128x128; not both 2), got ",
                    a_block, " and ", b_block);
  TORCH_CHECK_VALUE(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
                    op, ": expected out_dtype bfloat16, float16 or float32, got ", out_dtype);
  if (bias) {
    FUSIBLE_CHECK_DIM(op, "bias", (*bias), 1);
    TORCH_CHECK(bias->sym_size(0) == b.sym_size(0), op, ": expected bias of ", b.sym_size(0),
                " elements (N), got ", bias->sym_size(0));
    TORCH_CHECK_VALUE(bias->scalar_type() == out_dtype, op, ": expected bias of dtype ", out_dtype,
                      " (out_dtype), got ", bias->scalar_type());
    FUSIBLE_CHECK_SAME_DEVICE(op, "a", a, "bias", (*bias));
  }
  if (act != "none") {
    reference::check_epilogue_act(op, act);
    TORCH_CHECK_VALUE(!other, op, ": an activation (act='", act, "') takes no other");
  }
  TORCH_CHECK_VALUE(!save_pre || act != "none", op, ": save_pre needs an activation");
  if (other) {
    TORCH_CHECK_VALUE(other->scalar_type() == out_dtype, op, ": expected other of dtype ",
                      out_dtype, " (out_dtype), got ", other->scalar_type());
    FUSIBLE_CHECK_SAME_DEVICE(op, "a", a, "other", (*other));
    auto shape = a.sym_sizes().vec();
    shape.back() = b.sym_size(0);
    TORCH_CHECK(other->sym_sizes().equals(shape), op, ": expected other of shape ", shape, ", got ",
                other->sym_sizes());
  }
}

void check_fp8_gemm_out_args(const at::Tensor& a, const at::Tensor& a_scale_inv,
                             const at::Tensor& b, const at::Tensor& b_scale_inv,
                             const at::Tensor& out, const std::optional<at::Tensor>& bias,
                             int64_t a_block, int64_t b_block) {
  constexpr const char* op = "fp8_gemm_out";
  check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out.scalar_type(), bias, std::nullopt, "none",
                      false, a_block, b_block, op);
  FUSIBLE_CHECK_SAME_DEVICE(op, "a", a, "out", out);
  auto shape = a.sym_sizes().vec();
  shape.back() = b.sym_size(0);
  TORCH_CHECK(out.sym_sizes().equals(shape), op, ": expected out of shape ",
              c10::SymIntArrayRef(shape), ", got ", out.sym_sizes());
}

namespace {

// The scale_inv of an operand [rows, K] as its block mode says (concrete sizes: not for Meta).
void check_scale_layout(const char* name, const at::Tensor& s, int64_t rows, int64_t k,
                        int64_t block) {
  if (block == 0) {
    TORCH_CHECK_VALUE(s.dim() == 1 && s.numel() == 1, "fp8_gemm: expected a one-element ", name,
                      " (per-tensor scale), got shape ", s.sizes());
    return;
  }
  const auto want = block_scale_shape(rows, k, block);
  TORCH_CHECK_VALUE(s.sizes().equals(want), "fp8_gemm: expected ", name, " of shape ",
                    at::IntArrayRef(want), " (", block == 1 ? "1x128" : "128x128",
                    " block scales), got ", s.sizes());
}

void check_scale_sizes(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                       const at::Tensor& b_scale_inv, int64_t a_block, int64_t b_block) {
  const int64_t k = a.size(-1), m = k > 0 ? a.numel() / k : 0;
  check_scale_layout("a_scale_inv", a_scale_inv, m, k, a_block);
  check_scale_layout("b_scale_inv", b_scale_inv, b.size(0), k, b_block);
}

// The operand [rows, K] dequantized into fp32 (exact: FP8 values times powers of two or one
// fp32 scale).
at::Tensor dequantize(const at::Tensor& t, const at::Tensor& scale_inv, int64_t block) {
  if (block == 0) return t.to(at::kFloat) * scale_inv;
  return reference::dequantize_block(t, scale_inv, block).reshape(t.sizes());
}

std::tuple<at::Tensor, at::Tensor> fp8_gemm_meta(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                                 const at::Tensor& b, const at::Tensor& b_scale_inv,
                                                 at::ScalarType out_dtype,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<at::Tensor>& other, double,
                                                 c10::string_view act, bool save_pre, bool,
                                                 int64_t a_block, int64_t b_block) {
  check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, act, save_pre,
                      a_block, b_block);
  auto shape = a.sym_sizes().vec();
  shape.back() = b.sym_size(0);
  const auto opts = a.options().dtype(out_dtype);
  auto d = at::empty_symint(shape, opts);
  return {d, save_pre ? at::empty_symint(shape, opts) : at::empty({0}, opts)};
}

void fp8_gemm_out_meta(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                       const at::Tensor& b_scale_inv, const at::Tensor& out,
                       const std::optional<at::Tensor>& bias, double, bool, int64_t a_block,
                       int64_t b_block, bool) {
  check_fp8_gemm_out_args(a, a_scale_inv, b, b_scale_inv, out, bias, a_block, b_block);
}

}  // namespace

namespace reference {

std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                                            at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& other, double alpha,
                                            c10::string_view act, bool save_pre, bool,
                                            int64_t a_block, int64_t b_block) {
  check_fp8_gemm_args(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, act, save_pre,
                      a_block, b_block);
  check_scale_sizes(a, a_scale_inv, b, b_scale_inv, a_block, b_block);
  // The FP8 values dequantized exactly into fp32, one fp32 GEMM, the epilogue in fp32.
  const auto af = dequantize(a, a_scale_inv, a_block);
  const auto bf = dequantize(b, b_scale_inv, b_block);
  auto d = at::matmul(af, bf.t());
  if (alpha != 1.0) d.mul_(alpha);
  if (bias) d.add_(bias->to(at::kFloat));
  if (other) d.add_(other->to(at::kFloat));
  auto pre = at::empty({0}, a.options().dtype(out_dtype));
  if (act != "none") {
    if (save_pre) pre = d.to(out_dtype);
    d = activation_fwd(d, std::string(act));
  }
  return {d.to(out_dtype), pre};
}

void fp8_gemm_out(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                  const at::Tensor& b_scale_inv, const at::Tensor& out,
                  const std::optional<at::Tensor>& bias, double alpha, bool fast_accum,
                  int64_t a_block, int64_t b_block, bool accumulate) {
  check_fp8_gemm_out_args(a, a_scale_inv, b, b_scale_inv, out, bias, a_block, b_block);
  if (!accumulate) {
    out.copy_(
        std::get<0>(fp8_gemm(a, a_scale_inv, b, b_scale_inv, out.scalar_type(), bias, std::nullopt,
                             alpha, "none", false, fast_accum, a_block, b_block)));
    return;
  }
  // The fp32 product added to out, rounded once to out's dtype.
  const auto acc = at::promote_types(out.scalar_type(), at::kFloat);
  const auto bias32 = bias ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
  out.copy_(std::get<0>(fp8_gemm(a, a_scale_inv, b, b_scale_inv, at::kFloat, bias32, std::nullopt,
                                 alpha, "none", false, fast_accum, a_block, b_block))
                .to(acc)
                .add_(out.to(acc)));
}

}  // namespace reference

// ---- Entry points for C++ callers (declared in fp8_gemm.h).

std::tuple<at::Tensor, at::Tensor> fp8_gemm(const at::Tensor& a, const at::Tensor& a_scale_inv,
                                            const at::Tensor& b, const at::Tensor& b_scale_inv,
                                            at::ScalarType out_dtype,
                                            const std::optional<at::Tensor>& bias,
                                            const std::optional<at::Tensor>& other, double alpha,
                                            const std::string& act, bool save_pre, bool fast_accum,
                                            int64_t a_block, int64_t b_block) {
  FUSIBLE_DISPATCH(fp8_gemm, a, a_scale_inv, b, b_scale_inv, out_dtype, bias, other, alpha, act,
                   save_pre, fast_accum, a_block, b_block);
}

void fp8_gemm_out(const at::Tensor& a, const at::Tensor& a_scale_inv, const at::Tensor& b,
                  const at::Tensor& b_scale_inv, const at::Tensor& out,
                  const std::optional<at::Tensor>& bias, double alpha, bool fast_accum,
                  int64_t a_block, int64_t b_block, bool accumulate) {
  FUSIBLE_DISPATCH(fp8_gemm_out, a, a_scale_inv, b, b_scale_inv, out, bias, alpha, fast_accum,
                   a_block, b_block, accumulate);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // d = act(alpha * (a * a_scale_inv) @ (b * b_scale_inv)^T + bias + other) in out_dtype: a
  // [..., K] and b [N, K] FP8 (not both e5m2), fp32 accumulation (fast_accum: cuBLASLt's faster,
  // less exact one). act 'none', 'gelu' (tanh) or 'relu' (then no other). -> (d, the
  // pre-activation when save_pre, else empty).
  define(
      m,
      "fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype, "
      "Tensor? bias=None, Tensor? other=None, float alpha=1.0, str act='none', bool "
      "save_pre=False, "
      "bool fast_accum=False, int a_block=0, int b_block=0) -> (Tensor, Tensor)");
  // fp8_gemm without activation or other, written into out [..., N] (its dtype the output's):
  // the GEMMs of row groups filling one output (GroupedLinear), each in place where cuBLASLt can
  // write out directly. accumulate: added to out instead (beta = 1; the product in fp32, so an
  // fp32 out accumulates in fp32: a weight gradient into its main_grad).
  define(m,
         "fp8_gemm_out(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, Tensor(a!) out, "
         "Tensor? bias=None, float alpha=1.0, bool fast_accum=False, int a_block=0, int "
         "b_block=0, bool accumulate=False) -> ()");
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  m.impl("fp8_gemm", &reference::fp8_gemm);
  m.impl("fp8_gemm_out", &reference::fp8_gemm_out);
}

TORCH_LIBRARY_IMPL(fusible, Meta, m) {
  m.impl("fp8_gemm", &fp8_gemm_meta);
  m.impl("fp8_gemm_out", &fp8_gemm_out_meta);
}

}  // namespace fusible::kernels

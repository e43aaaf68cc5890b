// Rotary position embedding fused with the split of a packed q/k/v projection into heads: argument
// checks and the ATen reference (CPU, Meta), computed in fp32 (fp64 for fp64). CUDA:
// rotary_cuda.cpp.
#include "kernels/rotary/rotary.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {
namespace {

void check_tables(const char* op, const char* like_name, const at::Tensor& like,
                  const c10::SymInt& seq, const c10::SymInt& head_dim, const at::Tensor& cos,
                  const at::Tensor& sin) {
  for (const auto* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    FUSIBLE_CHECK_FLOATING(op, name, *t);
    FUSIBLE_CHECK_SAME_DEVICE(op, like_name, like, name, *t);
    TORCH_CHECK(t->dim() == 2 && t->sym_size(0) >= seq && t->sym_size(1) * 2 == head_dim, op,
                ": expected ", name, " of shape [>= ", seq, ", ", head_dim / 2,
                "] (positions, head_dim / 2), got ", t->sym_sizes());
  }
}

}  // namespace

void check_qkv_rotary_fwd_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                               int64_t num_heads) {
  const char* op = "qkv_rotary_fwd";
  FUSIBLE_CHECK_FLOATING(op, "qkv", qkv);
  FUSIBLE_CHECK_DIM(op, "qkv", qkv, 3);
  TORCH_CHECK_VALUE(num_heads > 0, op, ": expected num_heads > 0, got ", num_heads);
  const auto width = qkv.sym_size(2);
  TORCH_CHECK(width % (6 * num_heads) == 0, op,
              ": expected qkv's last dim to be 3 * num_heads * head_dim with an even head_dim (",
              num_heads, " heads), got ", width);
  check_tables(op, "qkv", qkv, qkv.sym_size(1), width / (3 * num_heads), cos, sin);
}

void check_qkv_rotary_bwd_args(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                               const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "qkv_rotary_bwd";
  FUSIBLE_CHECK_FLOATING(op, "dq", dq);
  FUSIBLE_CHECK_DIM(op, "dq", dq, 4);
  FUSIBLE_CHECK_SHAPE_LIKE(op, "dk", dk, dq);
  FUSIBLE_CHECK_SHAPE_LIKE(op, "dv", dv, dq);
  FUSIBLE_CHECK_SAME_DTYPE(op, "dq", dq, "dk", dk);
  FUSIBLE_CHECK_SAME_DTYPE(op, "dq", dq, "dv", dv);
  FUSIBLE_CHECK_SAME_DEVICE(op, "dq", dq, "dk", dk);
  FUSIBLE_CHECK_SAME_DEVICE(op, "dq", dq, "dv", dv);
  TORCH_CHECK(dq.sym_size(3) % 2 == 0, op, ": expected an even head_dim, got ", dq.sym_size(3));
  check_tables(op, "dq", dq, dq.sym_size(2), dq.sym_size(3), cos, sin);
}

}  // namespace reference

// The implementations registered under CompositeExplicitAutograd (named: the entry points below
// have the same names).
namespace composite {
namespace {

// cos and sin of positions [0, seq) as [1, seq, 1, 1, head_dim / 2] in dtype.
std::pair<at::Tensor, at::Tensor> tables(const at::Tensor& cos, const at::Tensor& sin,
                                         const c10::SymInt& seq, at::ScalarType dtype) {
  auto shape = [&](const at::Tensor& t) {
    return t.narrow_symint(0, 0, seq).to(dtype).view_symint({1, seq, 1, 1, t.sym_size(1)});
  };
  return {shape(cos), shape(sin)};
}

}  // namespace

at::Tensor qkv_rotary_fwd(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads) {
  reference::check_qkv_rotary_fwd_args(qkv, cos, sin, num_heads);
  const auto batch = qkv.sym_size(0), seq = qkv.sym_size(1);
  const auto head_dim = qkv.sym_size(2) / (3 * num_heads);
  const auto acc = acc_dtype(qkv.scalar_type());
  const auto [c, s] = tables(cos, sin, seq, acc);
  // Pairs (2i, 2i + 1) of q and k: [batch, seq, 2, heads, head_dim / 2, 2].
  const auto x =
      upcast(qkv).reshape_symint({batch, seq, 3, num_heads, head_dim / 2, 2}).narrow(2, 0, 2);
  const auto even = x.select(-1, 0), odd = x.select(-1, 1);
  return at::stack({even * c - odd * s, even * s + odd * c}, -1)
      .view_symint({batch, seq, 2, num_heads, head_dim})
      .to(qkv.scalar_type());
}

at::Tensor qkv_rotary_bwd(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& cos, const at::Tensor& sin) {
  reference::check_qkv_rotary_bwd_args(dq, dk, dv, cos, sin);
  const auto batch = dq.sym_size(0), heads = dq.sym_size(1), seq = dq.sym_size(2),
             head_dim = dq.sym_size(3);
  const auto acc = acc_dtype(dq.scalar_type());
  const auto [c, s] = tables(cos, sin, seq, acc);
  // [batch, seq, 2, heads, head_dim / 2, 2]
  const auto g = at::stack({dq.transpose(1, 2), dk.transpose(1, 2)}, 2)
                     .to(acc)
                     .reshape_symint({batch, seq, 2, heads, head_dim / 2, 2});
  const auto even = g.select(-1, 0), odd = g.select(-1, 1);
  const auto dqk = at::stack({even * c + odd * s, odd * c - even * s}, -1)
                       .view_symint({batch, seq, 2, heads, head_dim});
  const auto dvv = dv.transpose(1, 2).unsqueeze(2).to(acc);
  return at::cat({dqk, dvv}, 2)
      .view_symint({batch, seq, 3 * heads * head_dim})
      .to(dq.scalar_type());
}

}  // namespace composite

// ---- Entry points for C++ callers (declared in rotary.h).

at::Tensor qkv_rotary_fwd(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads) {
  FUSIBLE_DISPATCH(qkv_rotary_fwd, qkv, cos, sin, num_heads);
}
at::Tensor qkv_rotary_bwd(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& cos, const at::Tensor& sin) {
  FUSIBLE_DISPATCH(qkv_rotary_bwd, dq, dk, dv, cos, sin);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // qkv [batch, seq, 3 * heads * head_dim] -> q and k rotated, [batch, seq, 2, heads, head_dim]:
  // out[..., 2i] = x[2i] cos[s, i] - x[2i + 1] sin[s, i], out[..., 2i + 1] = x[2i] sin[s, i] +
  // x[2i + 1] cos[s, i] (interleaved pairs). v stays in qkv.
  define(m, "qkv_rotary_fwd(Tensor qkv, Tensor cos, Tensor sin, int num_heads) -> Tensor");
  // Gradients of q, k, v [batch, heads, seq, head_dim] -> that of qkv [batch, seq, 3 * heads *
  // head_dim].
  define(m, "qkv_rotary_bwd(Tensor dq, Tensor dk, Tensor dv, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("qkv_rotary_fwd", &composite::qkv_rotary_fwd);
  m.impl("qkv_rotary_bwd", &composite::qkv_rotary_bwd);
}

}  // namespace fusible::kernels

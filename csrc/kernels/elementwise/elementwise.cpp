// Small elementwise ops of the basic operations: constant scale and residual add (out of place and
// in place), through ATen in fp32 (fp64 for fp64). Dropout: kernels/dropout/.
#include "kernels/elementwise/elementwise.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/result_type.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

void check_add_args(const char* op, const at::Tensor& x, const at::Tensor& other) {
  FUSIBLE_CHECK_FLOATING(op, "x", x);
  FUSIBLE_CHECK_FLOATING(op, "other", other);
  FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "other", other);
  TORCH_CHECK(x.sym_sizes().equals(other.sym_sizes()), op, ": expected other of shape ",
              x.sym_sizes(), ", got ", other.sym_sizes());
}

// x + other in x's dtype.
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other) {
  check_add_args("add_fwd", x, other);
  // x the wider (an fp32 residual plus a bf16 output): one promoting add, no copy of other (it
  // converts exactly either way, so the same bits).
  const auto t = x.scalar_type();
  if ((t == at::kFloat || t == at::kDouble) && at::result_type(x, other) == t) return x + other;
  return (upcast(x) + upcast(other)).to(t);
}

// self += other, in self's storage and dtype: the sum in the promoted dtype, rounded once to self's
// (torch's `self += other`, which te.ops' in-place add runs).
void add_(const at::Tensor& self, const at::Tensor& other) {
  check_add_args("add_", self, other);
  self.add_(other);
}

}  // namespace reference

// The implementations registered under CompositeExplicitAutograd (named: the entry points
// below have the same names).
namespace composite {

using reference::add_;
using reference::add_fwd;

at::Tensor scale_fwd(const at::Tensor& x, double scale) {
  FUSIBLE_CHECK_FLOATING("scale_fwd", "x", x);
  return (upcast(x) * scale).to(x.scalar_type());
}

}  // namespace composite

// ---- Entry points for C++ callers (declared in elementwise.h).

at::Tensor scale_fwd(const at::Tensor& x, double scale) { FUSIBLE_DISPATCH(scale_fwd, x, scale); }
at::Tensor add_fwd(const at::Tensor& x, const at::Tensor& other) {
  FUSIBLE_DISPATCH(add_fwd, x, other);
}
void add_(const at::Tensor& self, const at::Tensor& other) { FUSIBLE_DISPATCH(add_, self, other); }

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // y = scale * x (also ConstantScale's backward).
  define(m, "scale_fwd(Tensor x, float scale) -> Tensor");
  // y = x + other, same shapes, in x's dtype.
  define(m, "add_fwd(Tensor x, Tensor other) -> Tensor");
  // self += other in place (AddExtraInput(in_place=True)).
  define(m, "add_(Tensor(a!) self, Tensor other) -> ()");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("scale_fwd", &composite::scale_fwd);
  m.impl("add_fwd", &composite::add_fwd);
  m.impl("add_", &composite::add_);
}

}  // namespace fusible::kernels

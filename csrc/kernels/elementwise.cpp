// Small elementwise ops of the basic operations: constant scale, residual add (out of place and in
// place), and dropout with its saved keep-mask.
#include "kernels/elementwise.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/compute_dtype.h"

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
  return (upcast(x) + upcast(other)).to(x.scalar_type());
}

// self += other, in self's storage and dtype.
void add_(const at::Tensor& self, const at::Tensor& other) {
  check_add_args("add_", self, other);
  self.add_(other.to(self.scalar_type()));
}

}  // namespace reference

namespace {

using reference::add_;
using reference::add_fwd;

at::Tensor scale_fwd(const at::Tensor& x, double scale) {
  FUSIBLE_CHECK_FLOATING("scale_fwd", "x", x);
  return (upcast(x) * scale).to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p) {
  FUSIBLE_CHECK_FLOATING("dropout_fwd", "x", x);
  TORCH_CHECK_VALUE(p >= 0 && p <= 1, "dropout_fwd: expected 0 <= p <= 1, got ", p);
  auto keep = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  keep.bernoulli_(1 - p);
  const auto mask = keep.to(at::kBool);
  const double scale = p < 1 ? 1 / (1 - p) : 0;
  return {(upcast(x) * mask * scale).to(x.scalar_type()), mask};
}

at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p) {
  FUSIBLE_CHECK_FLOATING("dropout_bwd", "dy", dy);
  TORCH_CHECK(mask.sizes().equals(dy.sizes()), "dropout_bwd: expected mask of shape ", dy.sizes(),
              ", got ", mask.sizes());
  const double scale = p < 1 ? 1 / (1 - p) : 0;
  return (upcast(dy) * mask * scale).to(dy.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("scale_fwd", &scale_fwd);
  m.impl("add_fwd", &add_fwd);
  m.impl("add_", &add_);
  m.impl("dropout_fwd", &dropout_fwd);
  m.impl("dropout_bwd", &dropout_bwd);
}

}  // namespace fusible::kernels

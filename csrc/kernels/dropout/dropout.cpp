// Dropout with its saved keep-mask (bits: element e is bit e % 8 of byte e / 8): argument checks
// and the ATen reference (CPU, Meta), computed in fp32 (fp64 for fp64). CUDA: dropout_cuda.cpp.
#include "kernels/dropout/dropout.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bernoulli.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/bitwise_left_shift.h>
#include <ATen/ops/bitwise_right_shift.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "common/checks.h"
#include "kernels/common/compute_dtype.h"
#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace reference {

void check_dropout_fwd_args(const at::Tensor& x, double p) {
  FUSIBLE_CHECK_FLOATING("dropout_fwd", "x", x);
  TORCH_CHECK_VALUE(p >= 0 && p <= 1, "dropout_fwd: expected 0 <= p <= 1, got ", p);
}

void check_dropout_bwd_args(const at::Tensor& dy, const at::Tensor& mask) {
  FUSIBLE_CHECK_FLOATING("dropout_bwd", "dy", dy);
  FUSIBLE_CHECK_SAME_DEVICE("dropout_bwd", "dy", dy, "mask", mask);
  const auto bytes = (dy.sym_numel() + 7) / 8;
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.dim() == 1 && mask.sym_size(0) == bytes,
              "dropout_bwd: expected a uint8 bit mask of ", bytes, " bytes (dy has ",
              dy.sym_numel(), " elements), got ", mask.scalar_type(), " of shape ",
              mask.sym_sizes());
}

}  // namespace reference

// The implementations registered under CompositeExplicitAutograd (named: the entry points
// below have the same names).
namespace composite {

// Element e's keep flag is bit e % 8 of byte e / 8 (the CUDA kernels' layout).
at::Tensor pack_bits(const at::Tensor& keep) {
  const auto flat = keep.reshape({-1}).to(at::kByte);
  const auto pad = (8 - flat.sym_numel() % 8) % 8;
  const auto padded = at::constant_pad_nd_symint(flat, {0, pad}, 0);
  const auto shifts = at::arange(8, flat.options());
  return at::bitwise_left_shift(padded.view({-1, 8}), shifts).sum(1, /*keepdim=*/false, at::kByte);
}

at::Tensor unpack_bits(const at::Tensor& mask, const at::Tensor& like) {
  const auto shifts = at::arange(8, mask.options());
  const auto bits = at::bitwise_and(at::bitwise_right_shift(mask.unsqueeze(-1), shifts), 1);
  return bits.reshape({-1}).narrow_symint(0, 0, like.sym_numel()).view_symint(like.sym_sizes());
}

std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p) {
  reference::check_dropout_fwd_args(x, p);
  auto keep = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  keep.bernoulli_(1 - p);
  const auto mask = keep.to(at::kBool);
  const double scale = p < 1 ? 1 / (1 - p) : 0;
  return {(upcast(x) * mask * scale).to(x.scalar_type()), pack_bits(mask)};
}

at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p) {
  reference::check_dropout_bwd_args(dy, mask);
  const double scale = p < 1 ? 1 / (1 - p) : 0;
  return (upcast(dy) * unpack_bits(mask, dy) * scale).to(dy.scalar_type());
}

}  // namespace composite

// ---- Entry points for C++ callers (declared in dropout.h).

std::tuple<at::Tensor, at::Tensor> dropout_fwd(const at::Tensor& x, double p) {
  FUSIBLE_DISPATCH(dropout_fwd, x, p);
}
at::Tensor dropout_bwd(const at::Tensor& dy, const at::Tensor& mask, double p) {
  FUSIBLE_DISPATCH(dropout_bwd, dy, mask, p);
}

// The schemas of the ops this file implements (torch.ops.fusible.<name>).
TORCH_LIBRARY_FRAGMENT(fusible, m) {
  // Dropout: -> (y, keep mask as bits [uint8, ceil(numel / 8)]: element e is bit e % 8 of byte
  // e / 8); y = x * keep / (1 - p).
  define(m, "dropout_fwd(Tensor x, float p) -> (Tensor, Tensor)",
         {at::Tag::nondeterministic_seeded});
  // Dropout backward from the saved mask.
  define(m, "dropout_bwd(Tensor dy, Tensor mask, float p) -> Tensor");
}

TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("dropout_fwd", &composite::dropout_fwd);
  m.impl("dropout_bwd", &composite::dropout_bwd);
}

}  // namespace fusible::kernels

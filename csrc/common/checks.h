// Argument checks shared by every layer: each message names the op, the argument, what was expected
// and what came, so a user can fix the call without reading our code.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <sstream>
#include <string>

namespace fusible {

/// "[2, 3]"-style rendering of a tensor's sizes for error messages.
inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

}  // namespace fusible

/// FUSIBLE_CHECK_FLOATING(op, "x", x): a floating-point tensor.
#define FUSIBLE_CHECK_FLOATING(op, name, t)                          \
  TORCH_CHECK_TYPE((t).is_floating_point(), op, ": expected ", name, \
                   " to be a floating-point tensor, got ", (t).scalar_type())

/// FUSIBLE_CHECK_SAME_DEVICE(op, "x", x, "weight", w): both tensors on one device.
#define FUSIBLE_CHECK_SAME_DEVICE(op, name_a, a, name_b, b)                             \
  TORCH_CHECK((a).device() == (b).device(), op, ": expected ", name_a, " and ", name_b, \
              " on the same device, got ", (a).device(), " and ", (b).device())

/// FUSIBLE_CHECK_SAME_DTYPE(op, "x", x, "weight", w): both tensors of one dtype.
#define FUSIBLE_CHECK_SAME_DTYPE(op, name_a, a, name_b, b)                                     \
  TORCH_CHECK_TYPE((a).scalar_type() == (b).scalar_type(), op, ": expected ", name_a, " and ", \
                   name_b, " of the same dtype, got ", (a).scalar_type(), " and ",             \
                   (b).scalar_type())

/// FUSIBLE_CHECK_DIM(op, "weight", w, 2): exact rank.
#define FUSIBLE_CHECK_DIM(op, name, t, n)                                                          \
  TORCH_CHECK((t).dim() == (n), op, ": expected ", name, " to have ", n, " dims, got ", (t).dim(), \
              " (shape ", ::fusible::shape_str(t), ")")

/// FUSIBLE_CHECK_MIN_DIM(op, "x", x, 1): rank at least n.
#define FUSIBLE_CHECK_MIN_DIM(op, name, t, n)                                                    \
  TORCH_CHECK((t).dim() >= (n), op, ": expected ", name, " to have at least ", n, " dims, got ", \
              (t).dim(), " (shape ", ::fusible::shape_str(t), ")")

/// FUSIBLE_CHECK_SHAPE_LIKE(op, "dy", dy, x): t has the shape of like (symbolic sizes compared).
#define FUSIBLE_CHECK_SHAPE_LIKE(op, name, t, like)                                              \
  TORCH_CHECK((t).sym_sizes().equals((like).sym_sizes()), op, ": expected ", name, " of shape ", \
              (like).sym_sizes(), ", got ", (t).sym_sizes())

/// FUSIBLE_CHECK_SIZE(op, "x.size(-1)", got, expected): one size against the size it must match.
#define FUSIBLE_CHECK_SIZE(op, what, got, expected) \
  TORCH_CHECK((got) == (expected), op, ": expected ", what, " == ", expected, ", got ", got)

// Typed dispatcher handles behind kernels/ops.h; each schema is looked up once.
#include "kernels/ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace fusible::kernels {
namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

at::Tensor bias_fwd(const at::Tensor& x, const at::Tensor& bias) {
  static const auto op = handle<at::Tensor(const at::Tensor&, const at::Tensor&)>("fusible::bias_fwd");
  return op.call(x, bias);
}

at::Tensor bias_bwd(const at::Tensor& dy) {
  static const auto op = handle<at::Tensor(const at::Tensor&)>("fusible::bias_bwd");
  return op.call(dy);
}

}  // namespace fusible::kernels

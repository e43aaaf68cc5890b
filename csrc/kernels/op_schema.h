// How a kernel family defines its ops beside their implementations: define() adds a schema to
// torch.ops.fusible (and the not-implemented Autograd kernel), FUSIBLE_DISPATCH implements the
// typed C++ entry point declared in the family's header by calling through the dispatcher.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace fusible::kernels {

/// m.def(schema) plus the Autograd kernel that raises when a backward reaches the op: no op here
/// has a derivative formula (the fuser's one autograd node differentiates whole calls), and the
/// error names the op instead of PyTorch's "autograd kernel was not registered" warning.
void define(torch::Library& m, const char* schema, const std::vector<at::Tag>& tags = {});

namespace detail {
// The schema's C++ signature for an entry point's: `str` arguments are string views there.
template <typename T>
struct SchemaArg {
  using type = T;
};
template <>
struct SchemaArg<const std::string&> {
  using type = c10::string_view;
};
template <typename F>
struct SchemaSignature;
template <typename R, typename... Args>
struct SchemaSignature<R(Args...)> {
  using type = R(typename SchemaArg<Args>::type...);
};
}  // namespace detail

/// The typed handle of fusible::<name> for an entry point of type F (looked up once per caller).
template <typename F>
c10::TypedOperatorHandle<typename detail::SchemaSignature<F>::type> typed_handle(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(name, "")
      .typed<typename detail::SchemaSignature<F>::type>();
}

}  // namespace fusible::kernels

/// The body of entry point `name`: the op fusible::name called with the given arguments.
#define FUSIBLE_DISPATCH(name, ...)                                                           \
  static const auto op = ::fusible::kernels::typed_handle<decltype(name)>("fusible::" #name); \
  return op.call(__VA_ARGS__)

// The torch.ops.fusible namespace. Each kernel family defines its ops beside their implementations
// (a TORCH_LIBRARY_FRAGMENT per file, through define()); the compiled Sequential's call ops are in
// fuser/compiled_call.cpp.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "kernels/op_schema.h"

namespace fusible::kernels {

void define(torch::Library& m, const char* schema, const std::vector<at::Tag>& tags) {
  m.def(schema, tags);
  const std::string s(schema);
  const std::string name = s.substr(0, s.find('('));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd,
                                       torch::autograd::autogradNotImplementedFallback()));
}

}  // namespace fusible::kernels

// Owns the namespace: another library cannot define ops in it.
TORCH_LIBRARY(fusible, m) {}

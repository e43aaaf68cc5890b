// The torch.ops.fusible namespace. Each kernel family defines its ops beside their implementations
// (a TORCH_LIBRARY_FRAGMENT per file, through define()); the compiled Sequential's call ops are in
// fuser/compiled_call.cpp.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>

#include "kernels/op_schema.h"

namespace fusible::kernels {
namespace {

// The ops take and return the dtypes they are given: torch.autocast must not cast their inputs,
// nor the ATen calls inside the CPU references (an autocast at::mm there returned bf16 where the
// reference computes in fp32). So the op runs with the autocast keys excluded.
void without_autocast(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                      torch::jit::Stack* stack) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // keys holds nothing above autocast (the dispatcher picked an autocast key as the highest).
  op.redispatchBoxed(keys - c10::autocast_dispatch_keyset, stack);
}

}  // namespace

void define(torch::Library& m, const char* schema, const std::vector<at::Tag>& tags) {
  m.def(schema, tags);
  const std::string s(schema);
  const std::string name = s.substr(0, s.find('('));
  m.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd,
                                       torch::autograd::autogradNotImplementedFallback()));
  for (const auto key : {c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA}) {
    m.impl(name.c_str(),
           torch::dispatch(key, torch::CppFunction::makeFromBoxedFunction<&without_autocast>()));
  }
}

}  // namespace fusible::kernels

// Owns the namespace: another library cannot define ops in it.
TORCH_LIBRARY(fusible, m) {}

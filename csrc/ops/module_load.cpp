// FusibleOperation::load: torch::load into meta (deferred) parameters. Its own file: the archive's
// header pulls in TorchScript's module headers.
#include <torch/serialize/input-archive.h>

#include <vector>

#include "ops/fusible_operation.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {

void FusibleOperation::load(torch::serialize::InputArchive& archive) {
  std::vector<at::Tensor> made;  // the parameters this load makes real
  for (const auto& param : named_parameters(/*recurse=*/false)) {
    if (!param.value().is_meta()) continue;  // a shared one may be real already (Linear's weight)
    at::Tensor loaded;
    if (archive.try_read(param.key(), loaded) && !loaded.is_meta()) {
      materialize_(param.value(), loaded.device());
      made.push_back(param.value());
    }
  }
  try {
    torch::nn::Module::load(archive);
  } catch (...) {
    // Back to meta, as before the load: left real, a parameter the load did not reach would hold
    // uninitialized memory that no first forward initializes.
    for (const auto& p : made) materialize_(p, c10::Device(c10::kMeta));
    throw;
  }
}

}  // namespace fusible::ops

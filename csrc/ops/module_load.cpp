// FusibleOperation::load: torch::load into meta (deferred) parameters. Its own file: the archive's
// header pulls in TorchScript's module headers.
#include <torch/serialize/input-archive.h>

#include "ops/fusible_operation.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {

void FusibleOperation::load(torch::serialize::InputArchive& archive) {
  for (const auto& param : named_parameters(/*recurse=*/false)) {
    if (!param.value().is_meta()) continue;  // a shared one may be real already (Linear's weight)
    at::Tensor loaded;
    if (archive.try_read(param.key(), loaded) && !loaded.is_meta()) {
      materialize_(param.value(), loaded.device());
    }
  }
  torch::nn::Module::load(archive);
}

}  // namespace fusible::ops

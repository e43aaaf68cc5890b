// The one schema table of torch.ops.fusible: every kernel-level op, with one comment each.
// Implementations register beside their code, one TORCH_LIBRARY_IMPL block per dispatch key.
#include <torch/library.h>

TORCH_LIBRARY(fusible, m) {
  // y = x + bias, bias broadcast over the last dim. x: [..., N], bias: [N].
  m.def("bias_fwd(Tensor x, Tensor bias) -> Tensor");
  // Bias gradient: dy summed over every leading dim. dy: [..., N] -> [N].
  m.def("bias_bwd(Tensor dy) -> Tensor");
}

// The pybind11 module fusible._C: argument conversion only; the logic lives in libfusible.
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusible C++ core (operations, fuser, kernels)";
#ifdef FUSIBLE_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  m.attr("version") = FUSIBLE_VERSION;        // the C++ build's (CMake's project version)
  m.attr("cuda_archs") = FUSIBLE_CUDA_ARCHS;  // TORCH_CUDA_ARCH_LIST of the kernels, or ""
  fusible::python::bind_context(m);
  fusible::python::bind_ops(m);
  fusible::python::bind_fuser(m);
  fusible::python::bind_python_ops(m);
  fusible::python::bind_fusions(m);
  fusible::python::bind_quantization(m);
}

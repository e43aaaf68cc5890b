// pybind11 bindings for the FP8 autocast state (fusible.autocast is Python; the state is C++'s,
// per thread) and the Quantize op.
#include <fusible/fusible.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using ops::Fp8Autocast;
using ops::Fp8Recipe;

void bind_quantization(py::module_& m) {
  py::class_<Fp8Recipe, std::shared_ptr<Fp8Recipe>>(m, "Fp8Recipe")
      .def(py::init([](std::string kind, std::string forward_format, std::string backward_format,
                       double margin) {
             return std::make_shared<Fp8Recipe>(Fp8Recipe{
                 std::move(kind), std::move(forward_format), std::move(backward_format), margin});
           }),
           py::arg("kind"), py::arg("forward_format"), py::arg("backward_format"),
           py::arg("margin"))
      .def_readonly("kind", &Fp8Recipe::kind)
      .def_readonly("forward_format", &Fp8Recipe::forward_format)
      .def_readonly("backward_format", &Fp8Recipe::backward_format)
      .def_readonly("margin", &Fp8Recipe::margin);
  // (enabled, recipe or None) in, the previous pair out: Python's autocast restores it on exit.
  m.def(
      "_exchange_fp8_autocast",
      [](bool enabled, std::shared_ptr<Fp8Recipe> recipe) {
        auto prev = ops::exchange_fp8_autocast(Fp8Autocast{enabled, std::move(recipe)});
        return std::make_pair(prev.enabled, std::const_pointer_cast<Fp8Recipe>(prev.recipe));
      },
      py::arg("enabled"), py::arg("recipe"));
  m.def("_fp8_autocast_state", [] {
    const auto& a = ops::fp8_autocast();
    return std::make_pair(a.enabled, std::const_pointer_cast<Fp8Recipe>(a.recipe));
  });

  py::class_<ops::Quantize, ops::BasicOperation, std::shared_ptr<ops::Quantize>>(m, "Quantize")
      .def(py::init<bool, bool>(), py::arg("forward"), py::arg("backward"));
}

}  // namespace fusible::python

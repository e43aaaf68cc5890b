// The fusion registry from Python: fusion functions f(ops, *, recipe) -> ops registered in the C++
// registry, and snapshot/restore of the whole registry.
#include <fusible/fusible.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using namespace fusible::ops;

namespace {

// Wraps a Python fusion function for the C++ registry: f(C++ ops, *, recipe) -> [(C++ op, the
// Python object it came from)] (fusible/ops/fusion_registry.py translates to and from the user's
// objects).
FusionFunction python_fusion(py::function f) {
  auto fn = std::make_shared<py::function>(std::move(f));
  // The registry may outlive the interpreter's tidy-up; drop the function with the GIL held.
  std::shared_ptr<py::function> holder(fn.get(), [fn](py::function*) mutable {
    release_with_gil(std::move(*fn));
    fn.reset();
  });
  return [holder](OpList ops, const FusionContext& ctx) -> OpList {
    py::gil_scoped_acquire gil;
    py::object result =
        (*holder)(ops, py::arg("recipe") = ctx.recipe.empty() ? py::object(py::none())
                                                              : py::object(py::str(ctx.recipe)));
    // (C++ op, the object the function returned). A fused op the function made (written in
    // Python) lives as long as the plan that holds it: the plan's pointer shares ownership of the
    // op and of its Python object (which holds the op, so the op cannot hold it back).
    // `pairs` holds the Python objects until each fused op has taken its own reference.
    auto pairs =
        result.cast<std::vector<std::pair<std::shared_ptr<FusibleOperation>, py::object>>>();
    OpList out;
    for (auto& [op, obj] : pairs) {
      if (auto python_object = op->is_fused() ? op->keep_alive() : nullptr) {
        auto owner =
            std::make_shared<std::pair<std::shared_ptr<FusibleOperation>, std::shared_ptr<void>>>(
                op, python_object);
        op = std::shared_ptr<FusibleOperation>(owner, op.get());
      }
      out.push_back(std::move(op));
    }
    return out;
  };
}

}  // namespace

void bind_fusions(py::module_& m) {
  m.def(
      "register_fusion",
      [](py::function f, const std::string& pass, bool prepend, const std::string& name) {
        TORCH_CHECK_VALUE(pass == "forward" || pass == "backward" || pass == "forward_backward",
                          "register_fusion: expected pass 'forward', 'backward' or "
                          "'forward_backward', got '",
                          pass, "'");
        const auto p = pass == "forward"    ? FusionPass::kForward
                       : pass == "backward" ? FusionPass::kBackward
                                            : FusionPass::kForwardBackward;
        return FusionRegistry::instance().add(name, p, python_fusion(std::move(f)), prepend);
      },
      py::arg("f"), py::arg("pass_"), py::arg("prepend"), py::arg("name"));
  m.def("unregister_fusion", [](int64_t id) { return FusionRegistry::instance().remove(id); });
  py::class_<FusionEntry>(m, "FusionEntry").def_readonly("id", &FusionEntry::id);
  m.def("snapshot_fusions", [] { return FusionRegistry::instance().snapshot(); });
  m.def("restore_fusions",
        [](std::vector<FusionEntry> s) { FusionRegistry::instance().restore(std::move(s)); });
}

}  // namespace fusible::python

// pybind11 bindings for OperationFuser and the fusion registry's introspection.
#include <torch/csrc/utils/pybind.h>

#include <fusible/fusible.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using fuser::OperationFuser;
using ops::FusibleOperation;

namespace {

// [(op, [basic indices])] of one plan.
py::list plan_entries(const std::vector<fuser::PlannedOp>& plan) {
  py::list out;
  for (const auto& p : plan) out.append(py::make_tuple(p.op, p.basic_indices));
  return out;
}

}  // namespace

void bind_fuser(py::module_& m) {
  py::class_<OperationFuser, std::shared_ptr<OperationFuser>>(m, "OperationFuser")
      .def(py::init<std::vector<std::shared_ptr<FusibleOperation>>>())
      .def("forward", &OperationFuser::forward, py::arg("input"), py::arg("extra_inputs"))
      .def_property_readonly("num_extra_inputs", &OperationFuser::num_extra_inputs)
      .def_property_readonly("num_extra_outputs", &OperationFuser::num_extra_outputs)
      .def("get_basic_ops", &OperationFuser::basic_ops)
      .def("fusion_plan", &OperationFuser::fusion_plan)
      .def("forward_ops", [](const OperationFuser& f) {
        return f.plan() ? plan_entries(f.plan()->forward) : py::list();
      })
      .def("backward_ops", [](const OperationFuser& f) {
        return f.plan() ? plan_entries(f.plan()->backward) : py::list();
      });
}

}  // namespace fusible::python

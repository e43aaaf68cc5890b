// pybind11 bindings for OperationFuser and the fusion registry's introspection.
#include <fusible/fusible.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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
  m.def("plan_group_channels",
        [](const std::vector<std::vector<std::shared_ptr<ops::BasicOperation>>>& groups,
           const std::set<std::string>& named_inputs) {
          py::list out;
          for (const auto& g : fuser::plan_group_channels(groups, named_inputs)) {
            out.append(py::make_tuple(g.external_inputs, g.export_channels));
          }
          return out;
        });

  py::class_<OperationFuser, std::shared_ptr<OperationFuser>>(m, "OperationFuser")
      .def(py::init([](std::vector<std::shared_ptr<FusibleOperation>> ops, bool lock_channels,
                       std::set<std::string> external_inputs,
                       std::set<std::string> export_channels) {
             fuser::FuserOptions options{lock_channels, std::move(external_inputs),
                                         std::move(export_channels)};
             return std::make_shared<OperationFuser>(std::move(ops), std::move(options));
           }),
           py::arg("ops"), py::arg("lock_channels") = true,
           py::arg("external_inputs") = std::set<std::string>(),
           py::arg("export_channels") = std::set<std::string>())
      .def("forward", &OperationFuser::forward, py::arg("input"), py::arg("extra_inputs"),
           py::arg("named_inputs") = std::vector<std::pair<std::string, at::Tensor>>(),
           py::arg("params") = std::nullopt)
      .def_property_readonly("parameter_counts",
                             [](const OperationFuser& f) {
                               std::vector<size_t> counts;
                               for (const auto& p : f.parameter_layout().pos)
                                 counts.push_back(p.size());
                               return counts;
                             })
      .def("exported",
           [](const OperationFuser& f) {
             py::list out;
             for (const auto& e : f.exported()) out.append(py::make_tuple(e.is_public, e.name));
             return out;
           })
      .def("external_inputs", &OperationFuser::external_inputs)
      .def("extra_input_sources",
           [](const OperationFuser& f) {
             py::list out;
             for (const auto& slots : f.routing().inputs) {
               py::list per_op;
               for (const auto& src : slots) {
                 if (src.kind == fuser::InputSource::Kind::kInternal) {
                   per_op.append(py::make_tuple(src.op, src.slot));
                 } else {
                   per_op.append(py::none());
                 }
               }
               out.append(per_op);
             }
             return out;
           })
      .def_property_readonly("num_extra_inputs", &OperationFuser::num_extra_inputs)
      .def_property_readonly("num_extra_outputs", &OperationFuser::num_extra_outputs)
      .def("get_basic_ops", &OperationFuser::basic_ops)
      .def("fusion_plan", &OperationFuser::fusion_plan)
      .def("forward_ops",
           [](const OperationFuser& f) {
             return f.plan() ? plan_entries(f.plan()->forward) : py::list();
           })
      .def("backward_ops", [](const OperationFuser& f) {
        return f.plan() ? plan_entries(f.plan()->backward) : py::list();
      });
}

}  // namespace fusible::python

// pybind11 bindings for OperationFuser and Sequential (the engine of Python's ops.Sequential).
#include <fusible/fusible.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using fuser::OperationFuser;
using fuser::Sequential;
using ops::FusibleOperation;

namespace {

// [(op, [basic indices])] of one plan.
// The fuser's plan, read without the GIL (a thread planning it may wait for the GIL under its
// lock).
std::shared_ptr<const fuser::Plan> current_plan(const OperationFuser& f) {
  py::gil_scoped_release no_gil;
  return f.plan();
}

py::list plan_entries(const std::vector<fuser::PlannedOp>& plan) {
  py::list out;
  for (const auto& p : plan) out.append(py::make_tuple(p.op, p.basic_indices));
  return out;
}

}  // namespace

void bind_fuser(py::module_& m) {
  py::class_<OperationFuser, std::shared_ptr<OperationFuser>>(m, "OperationFuser")
      .def(py::init([](std::vector<std::shared_ptr<FusibleOperation>> ops, bool lock_channels) {
             return std::make_shared<OperationFuser>(std::move(ops),
                                                     fuser::FuserOptions{lock_channels, {}, {}});
           }),
           py::arg("ops"), py::arg("lock_channels") = true)
      .def(
          "forward",
          [](OperationFuser& f, const at::Tensor& input,
             const std::vector<at::Tensor>& extra_inputs,
             const std::vector<std::pair<std::string, at::Tensor>>& named_inputs,
             const std::optional<std::vector<at::Tensor>>& params) {
            // Without the GIL: a collective's wait must not block Python threads (its callbacks
            // take the GIL back, as every Python callback from C++ does).
            py::gil_scoped_release no_gil;
            return f.forward(input, extra_inputs, named_inputs,
                             params ? std::optional<at::TensorList>(*params) : std::nullopt);
          },
          py::arg("input"), py::arg("extra_inputs"),
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
      // Without the GIL: a thread planning this fuser may hold its lock while it waits for the
      // GIL (a Python fusion function).
      .def("fusion_plan", &OperationFuser::fusion_plan, py::call_guard<py::gil_scoped_release>())
      .def("forward_ops",
           [](const OperationFuser& f) {
             const auto plan = current_plan(f);
             return plan ? plan_entries(plan->forward) : py::list();
           })
      .def("backward_ops", [](const OperationFuser& f) {
        const auto plan = current_plan(f);
        return plan ? plan_entries(plan->backward) : py::list();
      });

  // Python modules between fuser groups are plain steps: callables from tensor to tensor.
  py::class_<Sequential, std::shared_ptr<Sequential>>(m, "Sequential")
      .def(py::init<>())
      .def("append_op",
           py::overload_cast<std::shared_ptr<FusibleOperation>>(&Sequential::push_back))
      .def("append_step",
           py::overload_cast<Sequential::TensorFn, std::string>(&Sequential::push_back))
      .def("__len__", &Sequential::size)
      .def("set_isolated", &Sequential::set_isolated)
      .def(
          "run",
          [](Sequential& seq, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
             const Sequential::NamedTensors& named_inputs,
             const std::optional<std::vector<at::Tensor>>& params,
             const std::optional<Sequential::AroundFn>& around) {
            // The runner `around` hands to Python releases the GIL again for its group.
            Sequential::AroundFn wrapped;
            if (around) {
              wrapped = [py_around = *around](size_t entry, const at::Tensor& x,
                                              const std::vector<at::Tensor>& extras,
                                              const Sequential::GroupRunner& run) {
                Sequential::GroupRunner released =
                    [run](const at::Tensor& x, const std::vector<at::Tensor>& extras,
                          const std::optional<std::vector<at::Tensor>>& params) {
                      py::gil_scoped_release no_gil;
                      return run(x, extras, params);
                    };
                return py_around(entry, x, extras, released);
              };
            }
            py::gil_scoped_release no_gil;  // as OperationFuser.forward
            auto out = seq.run(input, extra_inputs, named_inputs, params, wrapped);
            return std::make_pair(std::move(out.outputs), std::move(out.named));
          },
          py::arg("input"), py::arg("extra_inputs"), py::arg("named_inputs"), py::arg("params"),
          py::arg("around") = std::nullopt)
      .def("groups", &Sequential::groups, py::arg("named_inputs") = std::set<std::string>())
      .def("fusion_plan", [](const Sequential& seq) {
        std::vector<fuser::GroupPlan> plan;
        {
          py::gil_scoped_release no_gil;  // as OperationFuser.fusion_plan
          plan = seq.fusion_plan();
        }
        py::list out;
        for (const auto& g : plan) {
          if (!g.module.empty()) {
            out.append(py::dict(py::arg("module") = g.module));
          } else {
            out.append(py::dict(py::arg("forward") = g.forward, py::arg("backward") = g.backward));
          }
        }
        return out;
      });

  // torch.compile's fusible::sequential_call finds a Sequential's engine by handle through fn.
  m.def("_forget_sequential", &fuser::forget_sequential);
  m.def("_delayed_scale_count", &fuser::delayed_scale_count);
  m.def("_set_sequential_resolver", [](const py::function& fn) {
    // Held by pointer, so copies of the resolver touch no Python reference count without the GIL.
    std::shared_ptr<py::function> held(new py::function(fn), [](py::function* f) {
      py::gil_scoped_acquire gil;
      delete f;
    });
    fuser::set_sequential_resolver([held](int64_t handle) {
      py::gil_scoped_acquire gil;
      return (*held)(handle).cast<std::shared_ptr<Sequential>>();
    });
  });
}

}  // namespace fusible::python

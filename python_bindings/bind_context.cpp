// OperationContext as Python sees it: shared with the fuser call, so a context a Python op keeps
// stays valid for as long as Python holds it; Python attributes live in a dict it owns.
#include <fusible/fusible.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using namespace fusible::ops;

// Drops a Python reference from C++ code that may run without the GIL (autograd threads) or after
// the interpreter has shut down (then the reference is leaked rather than touched).
void release_with_gil(py::object obj) {
  if (!obj) return;
  if (!Py_IsInitialized()) {
    obj.release();
    return;
  }
  py::gil_scoped_acquire gil;
  obj = py::object();
}

namespace {

// Python attributes of a context live in a dict owned by the C++ context (freed with the GIL).
py::dict& context_dict(OperationContext& ctx) {
  if (!ctx.binding_state) {
    ctx.binding_state = std::shared_ptr<void>(new py::dict(), [](void* p) {
      auto* d = static_cast<py::dict*>(p);
      release_with_gil(std::move(*d));
      delete d;
    });
  }
  return *static_cast<py::dict*>(ctx.binding_state.get());
}

}  // namespace

at::Tensor tensor_or_undefined(const py::handle& obj, const std::string& what) {
  if (obj.is_none()) return {};
  TORCH_CHECK_TYPE(THPVariable_Check(obj.ptr()), what, ": expected a tensor or None, got ",
                   std::string(py::str(py::type::of(obj))));
  return py::cast<at::Tensor>(obj);
}

namespace {

void save_from_python(OperationContext& ctx, const py::tuple& tensors) {
  std::vector<at::Tensor> ts;
  for (const auto& t : tensors) ts.push_back(tensor_or_undefined(t, "save_for_backward"));
  ctx.save_for_backward(std::move(ts));
  // A Python op may save any tensor (a buffer, an attribute): all get autograd's version checks.
  ctx.check_saved_versions = true;
}

}  // namespace

py::object context_object(OperationContext* ctx) {
  // Shared ownership where the context is owned by a fuser call; a caller's own context (a C++
  // test's, on its stack) is handed out by reference.
  if (auto shared = ctx->weak_from_this().lock()) return py::cast(std::move(shared));
  return py::cast(ctx, py::return_value_policy::reference);
}

py::list context_list(const std::vector<OperationContext*>& ctxs) {
  py::list out;
  for (auto* c : ctxs) out.append(context_object(c));
  return out;
}

constexpr const char* kNotSaved =
    "OperationContext.saved_tensors is set by the fuser for the backward, from what the forward "
    "saved; in the forward, read to_save";

void bind_context(py::module_& m) {
  py::class_<OperationContext, std::shared_ptr<OperationContext>>(
      m, "OperationContext", py::dynamic_attr(),
      "Per-call state of one basic op, from its forward to its backward: "
      "``save_for_backward(*tensors)``, ``saved_tensors``, ``requires_grad``, "
      "``input_requires_grad``, ``extra_input_requires_grad``, ``compute_dtype``, "
      "``input_dtype``, and any attribute the op sets.")
      .def(py::init([] { return std::make_shared<OperationContext>(); }))
      .def("save_for_backward",
           [](OperationContext& ctx, py::args tensors) { save_from_python(ctx, tensors); })
      // te.ops' fuser reads ctx.to_save; an op may assign it instead of save_for_backward.
      .def_property(
          "to_save",
          [](const OperationContext& ctx) {
            py::list out;
            for (const auto& t : ctx.to_save) out.append(t.defined() ? py::cast(t) : py::none());
            return py::tuple(out);
          },
          [](OperationContext& ctx, const py::object& tensors) {
            save_from_python(ctx, tensors.is_none() ? py::tuple() : py::tuple(tensors));
          })
      .def_property_readonly("saved_tensors",
                             [](OperationContext& ctx) {
                               // Set by the fuser after the forward, as te.ops' fuser does: read
                               // earlier, it would silently be something else.
                               if (!ctx.saved_for_backward) throw py::attribute_error(kNotSaved);
                               py::list out;
                               for (const auto& t : ctx.saved_tensors) {
                                 out.append(t.defined() ? py::cast(t) : py::none());
                               }
                               return py::tuple(out);
                             })
      .def_readwrite("requires_grad", &OperationContext::requires_grad)
      .def_readwrite("input_requires_grad", &OperationContext::input_requires_grad)
      .def_readwrite("compute_dtype", &OperationContext::compute_dtype)
      .def_readwrite("dtype", &OperationContext::compute_dtype)  // te.ops' name for it
      .def_readwrite("input_dtype", &OperationContext::input_dtype)
      .def_property_readonly("extra_input_requires_grad",
                             [](const OperationContext& c) {
                               return std::vector<bool>(c.extra_input_requires_grad.begin(),
                                                        c.extra_input_requires_grad.end());
                             })
      .def("__getattr__",
           [](OperationContext& ctx, const std::string& name) -> py::object {
             auto& d = context_dict(ctx);
             if (d.contains(name)) return d[py::str(name)];
             // (Python asks here after the property raised: keep its reason.)
             if (name == "saved_tensors") throw py::attribute_error(kNotSaved);
             throw py::attribute_error("OperationContext has no attribute '" + name + "'");
           })
      .def("__setattr__", [](py::object self, const std::string& name, py::object value) {
        // The fields bound above (properties of the class, declared once there) are set through
        // them; a read-only one raises. Any other name is the op's own attribute.
        if (py::hasattr(py::type::of(self), name.c_str())) {
          py::module_::import("builtins").attr("object").attr("__setattr__")(self, name, value);
          return;
        }
        context_dict(self.cast<OperationContext&>())[py::str(name)] = value;
      });
}

}  // namespace fusible::python

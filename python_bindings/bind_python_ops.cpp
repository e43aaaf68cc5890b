// Operations, fused operations and fusion functions written in Python (te.ops' protocol): C++
// trampolines that call back into Python, the OperationContext Python sees, and the registry hooks.
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

py::list context_list(const std::vector<OperationContext*>& ctxs) {
  py::list out;
  for (auto* c : ctxs) out.append(py::cast(c, py::return_value_policy::reference));
  return out;
}

py::list tensor_lists(const TensorLists& lists) {
  py::list out;
  for (const auto& l : lists) {
    py::list inner;
    for (const auto& t : l) inner.append(t.defined() ? py::cast(t) : py::none());
    out.append(inner);
  }
  return out;
}

// A list or tuple of exactly `n` tensors-or-None, with a message naming what it is.
std::vector<at::Tensor> fixed_list(const py::handle& obj, size_t n, const std::string& what) {
  TORCH_CHECK_TYPE(py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj), what,
                   ": expected a list or tuple, got ", std::string(py::str(py::type::of(obj))));
  const auto seq = py::reinterpret_borrow<py::sequence>(obj);
  TORCH_CHECK_VALUE(seq.size() == n, what, ": expected ", n, " entries, got ", seq.size());
  std::vector<at::Tensor> out;
  for (const auto& item : seq) {
    if (item.is_none()) {
      out.emplace_back();
    } else {
      TORCH_CHECK_TYPE(THPVariable_Check(item.ptr()), what, ": expected tensors or None, got ",
                       std::string(py::str(py::type::of(item))));
      out.push_back(py::cast<at::Tensor>(item));
    }
  }
  return out;
}

// A (first, second[, third]) result of user code.
py::tuple result_tuple(const py::object& r, size_t n, const std::string& what) {
  TORCH_CHECK_TYPE((py::isinstance<py::tuple>(r) || py::isinstance<py::list>(r)) && py::len(r) == n,
                   what, ": expected a tuple of ", n, " entries, got ", std::string(py::repr(r)));
  return py::tuple(r);
}

at::Tensor tensor_or_undefined(const py::handle& obj, const std::string& what) {
  if (obj.is_none()) return {};
  TORCH_CHECK_TYPE(THPVariable_Check(obj.ptr()), what, ": expected a tensor or None, got ",
                   std::string(py::str(py::type::of(obj))));
  return py::cast<at::Tensor>(obj);
}

std::vector<std::vector<at::Tensor>> nested_lists(const py::handle& obj,
                                                  const std::vector<size_t>& sizes,
                                                  const std::string& what) {
  TORCH_CHECK_TYPE(py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj), what,
                   ": expected a list with one entry per basic op, got ",
                   std::string(py::str(py::type::of(obj))));
  const auto seq = py::reinterpret_borrow<py::sequence>(obj);
  TORCH_CHECK_VALUE(seq.size() == sizes.size(), what, ": expected one entry per basic op (",
                    sizes.size(), "), got ", seq.size());
  std::vector<std::vector<at::Tensor>> out;
  for (size_t i = 0; i < sizes.size(); ++i) {
    out.push_back(fixed_list(seq[i], sizes[i], what + "[" + std::to_string(i) + "]"));
  }
  return out;
}

// Calls the Python protocol of a (basic or fused) op.
at::Tensor call_python_forward(const py::object& self, bool fuser_level,
                               const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                               const TensorLists& extra_inputs, TensorLists& extra_outputs,
                               const std::string& name) {
  if (!fuser_level) {
    auto r = self.attr("op_forward")(py::cast(ctxs[0], py::return_value_policy::reference), input,
                                     py::arg("prev_op_grad_output_quantizer") = py::none(),
                                     py::arg("next_op_input_quantizer") = py::none());
    return tensor_or_undefined(r, name + ".op_forward");
  }
  py::list kwargs;
  for (size_t i = 0; i < ctxs.size(); ++i) kwargs.append(py::dict());
  auto r = self.attr("fuser_forward")(
      context_list(ctxs), input, py::arg("basic_op_extra_inputs") = tensor_lists(extra_inputs),
      py::arg("prev_op_grad_output_quantizer") = py::none(),
      py::arg("next_op_input_quantizer") = py::none(), py::arg("basic_op_kwargs") = kwargs);
  const auto what = name + ".fuser_forward";
  const auto t = result_tuple(r, 2, what + " (output, extra outputs per basic op)");
  std::vector<size_t> sizes;
  for (const auto& e : extra_outputs) sizes.push_back(e.size());
  extra_outputs = nested_lists(t[1], sizes, what + " extra outputs");
  return tensor_or_undefined(t[0], what + " output");
}

BackwardResult call_python_backward(const py::object& self, bool fuser_level,
                                    const std::vector<OperationContext*>& ctxs,
                                    const at::Tensor& grad_output,
                                    const TensorLists& grad_extra_outputs,
                                    const std::vector<size_t>& num_params,
                                    const std::vector<size_t>& num_extra_inputs,
                                    const std::string& name) {
  py::object dy = grad_output.defined() ? py::cast(grad_output) : py::none();
  if (!fuser_level) {
    auto r = self.attr("op_backward")(py::cast(ctxs[0], py::return_value_policy::reference), dy);
    const auto what = name + ".op_backward";
    const auto t = result_tuple(r, 2, what + " (grad_input, parameter grads)");
    return {tensor_or_undefined(t[0], what + " grad_input"),
            {fixed_list(t[1], num_params[0], what + " parameter grads")},
            {std::vector<at::Tensor>(num_extra_inputs[0])}};
  }
  auto r = self.attr("fuser_backward")(
      context_list(ctxs), dy,
      py::arg("basic_op_grad_extra_outputs") = tensor_lists(grad_extra_outputs));
  const auto what = name + ".fuser_backward";
  const auto t = result_tuple(r, 3, what + " (grad_input, parameter grads, extra-input grads)");
  return {tensor_or_undefined(t[0], what + " grad_input"),
          nested_lists(t[1], num_params, what + " parameter grads"),
          nested_lists(t[2], num_extra_inputs, what + " extra-input grads")};
}

// A basic op whose computation is a Python object's op_forward/op_backward or
// fuser_forward/fuser_backward. Holds the Python object weakly: the Python module owns this.
class PyBasicOperation : public BasicOperation {
 public:
  PyBasicOperation(py::object self, std::string name, int64_t n_in, int64_t n_out,
                   bool fuser_forward, bool fuser_backward)
      : BasicOperation(std::move(name), n_in, n_out),
        self_(py::weakref(self)),
        fuser_forward_(fuser_forward),
        fuser_backward_(fuser_backward) {}
  ~PyBasicOperation() override { release_with_gil(std::move(self_)); }

  std::shared_ptr<void> keep_alive() const override {
    py::gil_scoped_acquire gil;
    return std::shared_ptr<void>(new py::object(self()), [](void* p) {
      auto* obj = static_cast<py::object*>(p);
      release_with_gil(std::move(*obj));
      delete obj;
    });
  }

  std::vector<at::Tensor> op_parameters() const override {
    py::gil_scoped_acquire gil;
    std::vector<at::Tensor> out;
    for (const auto& item : py::reinterpret_borrow<py::dict>(self().attr("_parameters"))) {
      if (!item.second.is_none()) out.push_back(py::cast<at::Tensor>(item.second));
    }
    return out;
  }
  void reset_parameters() override {
    py::gil_scoped_acquire gil;
    auto s = self();
    if (py::hasattr(s, "reset_parameters")) s.attr("reset_parameters")();
  }
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs&) override {
    py::gil_scoped_acquire gil;
    return call_python_forward(self(), fuser_forward_, ctxs, input, extra_inputs, extra_outputs,
                               type_name());
  }
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override {
    py::gil_scoped_acquire gil;
    return call_python_backward(self(), fuser_backward_, ctxs, grad_output, grad_extra_outputs,
                                {op_parameters().size()}, {static_cast<size_t>(num_extra_inputs())},
                                type_name());
  }

 private:
  py::object self() const {
    auto s = self_();
    TORCH_CHECK(!s.is_none(), type_name(), ": its Python object no longer exists");
    return s;
  }
  py::weakref self_;
  bool fuser_forward_;
  bool fuser_backward_;
};

// A fused op written in Python. Holds its Python object strongly: a fusion function makes it and
// the fuser's plan owns it. Directions the Python class leaves out run the basic ops unfused.
class PyFusedOperation : public FusedOperation {
 public:
  PyFusedOperation(py::object self, std::string name,
                   std::vector<std::shared_ptr<BasicOperation>> ops, bool has_forward,
                   bool has_backward)
      : FusedOperation(std::move(name), std::move(ops)),
        self_(std::move(self)),
        has_forward_(has_forward),
        has_backward_(has_backward) {
    set_fused_directions(has_forward, has_backward);
  }
  ~PyFusedOperation() override { release_with_gil(std::move(self_)); }
  py::object python_object() const { return self_; }

  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override {
    if (!has_forward_) {
      return FusedOperation::fuser_forward(ctxs, input, extra_inputs, extra_outputs, args);
    }
    py::gil_scoped_acquire gil;
    return call_python_forward(self_, true, ctxs, input, extra_inputs, extra_outputs, type_name());
  }
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override {
    if (!has_backward_)
      return FusedOperation::fuser_backward(ctxs, grad_output, grad_extra_outputs);
    py::gil_scoped_acquire gil;
    std::vector<size_t> num_params, num_extra;
    for (const auto& op : basic_ops_) {
      num_params.push_back(op->op_parameters().size());
      num_extra.push_back(static_cast<size_t>(op->num_extra_inputs()));
    }
    return call_python_backward(self_, true, ctxs, grad_output, grad_extra_outputs, num_params,
                                num_extra, type_name());
  }

 private:
  py::object self_;
  bool has_forward_;
  bool has_backward_;
};

// Wraps a Python fusion function f(ops, *, recipe) -> ops for the C++ registry. `to_python` and
// `to_cpp` (Python callables) translate between C++ op objects and the user's Python objects.
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
    return result.cast<OpList>();
  };
}

}  // namespace

void bind_python_ops(py::module_& m) {
  py::class_<OperationContext>(m, "OperationContext", py::dynamic_attr(),
                               "Per-call state of one basic op, from its forward to its backward: "
                               "save_for_backward(*tensors), saved_tensors, requires_grad, "
                               "input_requires_grad, extra_input_requires_grad, compute_dtype, "
                               "input_dtype, and any attribute the op sets.")
      .def("save_for_backward",
           [](OperationContext& ctx, py::args tensors) {
             std::vector<at::Tensor> ts;
             for (const auto& t : tensors)
               ts.push_back(tensor_or_undefined(t, "save_for_backward"));
             ctx.save_for_backward(std::move(ts));
           })
      .def_property_readonly("saved_tensors",
                             [](OperationContext& ctx) {
                               py::list out;
                               const auto& src =
                                   ctx.saved_tensors.empty() ? ctx.to_save : ctx.saved_tensors;
                               for (const auto& t : src) {
                                 out.append(t.defined() ? py::cast(t) : py::none());
                               }
                               return py::tuple(out);
                             })
      .def_readwrite("requires_grad", &OperationContext::requires_grad)
      .def_readwrite("input_requires_grad", &OperationContext::input_requires_grad)
      .def_readwrite("compute_dtype", &OperationContext::compute_dtype)
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
             throw py::attribute_error("OperationContext has no attribute '" + name + "'");
           })
      .def("__setattr__", [](py::object self, const std::string& name, py::object value) {
        static const std::set<std::string> kFields{"requires_grad", "input_requires_grad",
                                                   "compute_dtype", "input_dtype"};
        if (kFields.count(name)) {
          py::module_::import("builtins").attr("object").attr("__setattr__")(self, name, value);
          return;
        }
        context_dict(self.cast<OperationContext&>())[py::str(name)] = value;
      });

  py::class_<PyBasicOperation, BasicOperation, std::shared_ptr<PyBasicOperation>>(
      m, "PyBasicOperation")
      .def(py::init<py::object, std::string, int64_t, int64_t, bool, bool>());
  py::class_<PyFusedOperation, FusedOperation, std::shared_ptr<PyFusedOperation>>(
      m, "PyFusedOperation")
      .def(py::init<py::object, std::string, std::vector<std::shared_ptr<BasicOperation>>, bool,
                    bool>())
      .def_property_readonly("python_object", &PyFusedOperation::python_object);

  m.def(
      "register_fusion",
      [](py::function f, const std::string& pass, bool prepend, const std::string& name) {
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
  // Built-in ops from Python fused ops: run a basic op's own forward/backward on a context.
  m.def("basic_op_forward", [](BasicOperation& op, OperationContext& ctx, const at::Tensor& x) {
    return op.op_forward(ctx, x, forward_args_for(x));
  });
  m.def("basic_op_backward", [](BasicOperation& op, OperationContext& ctx, const at::Tensor& dy) {
    return op.op_backward(ctx, dy);
  });
}

}  // namespace fusible::python

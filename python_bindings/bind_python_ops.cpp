// Operations and fused operations written in Python (te.ops' protocol): C++ trampolines that call
// back into Python, and the built-in ops' own forward/backward for Python fused ops.
#include <fusible/common/autograd_keys.h>
#include <fusible/fusible.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using namespace fusible::ops;

namespace {

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
  const AutogradKeysOn with_autograd;  // the fuser runs below autograd; user code does not
  // Through the Python base classes' _call_op_forward / _call_fuser_forward: they add te.ops'
  // keywords and the call's op_kwargs (fusible/ops/_call.py).
  if (!fuser_level) {
    auto r = self.attr("_call_op_forward")(context_object(ctxs[0]), input);
    return tensor_or_undefined(r, name + ".op_forward");
  }
  auto r = self.attr("_call_fuser_forward")(context_list(ctxs), input, tensor_lists(extra_inputs));
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
  const AutogradKeysOn with_autograd;  // the fuser runs below autograd; user code does not
  py::object dy = grad_output.defined() ? py::cast(grad_output) : py::none();
  if (!fuser_level) {
    auto r = self.attr("op_backward")(context_object(ctxs[0]), dy);
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
// The Python object behind a trampoline, held weakly: the Python object owns the trampoline (its
// `_cpp`), so a strong reference back would be a cycle that Python's GC cannot see. Calls and
// plans hold it strongly through keep_alive() while they need it.
class PythonSelf {
 public:
  explicit PythonSelf(const py::object& self) : ref_(py::weakref(self)) {}
  ~PythonSelf() { release_with_gil(std::move(ref_)); }
  /// The object (None once Python has dropped it). Needs the GIL.
  py::object get() const { return ref_(); }
  /// The object, or an error naming the op. Needs the GIL.
  py::object checked(const std::string& op) const {
    auto s = get();
    TORCH_CHECK(!s.is_none(), op, ": its Python object no longer exists");
    return s;
  }
  /// A strong reference, released with the GIL wherever the last holder drops it.
  std::shared_ptr<void> keep_alive(const std::string& op) const {
    py::gil_scoped_acquire gil;
    return std::shared_ptr<void>(new py::object(checked(op)), [](void* p) {
      auto* obj = static_cast<py::object*>(p);
      release_with_gil(std::move(*obj));
      delete obj;
    });
  }

 private:
  py::weakref ref_;
};

// A basic op whose computation is a Python object's op_forward/op_backward or
// fuser_forward/fuser_backward.
class PyBasicOperation : public BasicOperation {
 public:
  PyBasicOperation(const py::object& self, std::string name, int64_t n_in, int64_t n_out,
                   bool fuser_forward, bool fuser_backward)
      : BasicOperation(std::move(name), n_in, n_out),
        self_(self),
        fuser_forward_(fuser_forward),
        fuser_backward_(fuser_backward) {}

  std::shared_ptr<void> keep_alive() const override { return self_.keep_alive(type_name()); }
  // Its parameters are Python's own (op_parameters): nothing registered in C++ to replace.
  void adopt_parameters(const std::vector<at::Tensor>&) override {}

  std::vector<at::Tensor> op_parameters() const override {
    py::gil_scoped_acquire gil;
    // Python keeps the order (op_backward's gradient order, across reparametrizations).
    return py::cast<std::vector<at::Tensor>>(self_.checked(type_name()).attr("_op_parameters")());
  }
  void reset_parameters() override {
    py::gil_scoped_acquire gil;
    auto s = self_.checked(type_name());
    if (py::hasattr(s, "reset_parameters")) s.attr("reset_parameters")();
  }
  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs&) override {
    py::gil_scoped_acquire gil;
    return call_python_forward(self_.checked(type_name()), fuser_forward_, ctxs, input,
                               extra_inputs, extra_outputs, type_name());
  }
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override {
    py::gil_scoped_acquire gil;
    return call_python_backward(self_.checked(type_name()), fuser_backward_, ctxs, grad_output,
                                grad_extra_outputs, {ctxs[0]->param_requires_grad.size()},
                                {static_cast<size_t>(num_extra_inputs())}, type_name());
  }

 private:
  PythonSelf self_;
  bool fuser_forward_;
  bool fuser_backward_;
};

// A fused op written in Python. Directions the Python class leaves out run the basic ops unfused.
// A fusion function's result is owned by the plan, which holds keep_alive() (bind_fusions.cpp).
class PyFusedOperation : public FusedOperation {
 public:
  PyFusedOperation(const py::object& self, std::string name,
                   std::vector<std::shared_ptr<BasicOperation>> ops, bool has_forward,
                   bool has_backward)
      : FusedOperation(std::move(name), std::move(ops)),
        self_(self),
        has_forward_(has_forward),
        has_backward_(has_backward) {
    set_fused_directions(has_forward, has_backward);
  }
  py::object python_object() const { return self_.get(); }
  std::shared_ptr<void> keep_alive() const override { return self_.keep_alive(type_name()); }

  at::Tensor fuser_forward(const std::vector<OperationContext*>& ctxs, const at::Tensor& input,
                           const TensorLists& extra_inputs, TensorLists& extra_outputs,
                           const ForwardArgs& args) override {
    if (!has_forward_) {
      return FusedOperation::fuser_forward(ctxs, input, extra_inputs, extra_outputs, args);
    }
    py::gil_scoped_acquire gil;
    return call_python_forward(self_.checked(type_name()), true, ctxs, input, extra_inputs,
                               extra_outputs, type_name());
  }
  BackwardResult fuser_backward(const std::vector<OperationContext*>& ctxs,
                                const at::Tensor& grad_output,
                                const TensorLists& grad_extra_outputs) override {
    if (!has_backward_)
      return FusedOperation::fuser_backward(ctxs, grad_output, grad_extra_outputs);
    py::gil_scoped_acquire gil;
    std::vector<size_t> num_params, num_extra;
    for (size_t k = 0; k < basic_ops_.size(); ++k) {
      num_params.push_back(ctxs[k]->param_requires_grad.size());  // as the call passed them
      num_extra.push_back(static_cast<size_t>(basic_ops_[k]->num_extra_inputs()));
    }
    return call_python_backward(self_.checked(type_name()), true, ctxs, grad_output,
                                grad_extra_outputs, num_params, num_extra, type_name());
  }

 private:
  PythonSelf self_;
  bool has_forward_;
  bool has_backward_;
};

}  // namespace

void bind_python_ops(py::module_& m) {
  py::class_<PyBasicOperation, BasicOperation, std::shared_ptr<PyBasicOperation>>(
      m, "PyBasicOperation")
      .def(py::init<const py::object&, std::string, int64_t, int64_t, bool, bool>());
  py::class_<PyFusedOperation, FusedOperation, std::shared_ptr<PyFusedOperation>>(
      m, "PyFusedOperation")
      .def(py::init<const py::object&, std::string, std::vector<std::shared_ptr<BasicOperation>>,
                    bool, bool>())
      .def_property_readonly("python_object", &PyFusedOperation::python_object);

  // Built-in ops from Python fused ops: run a basic op's own forward/backward on a context.
  // Without the GIL, as OperationFuser.forward: the op may wait for a collective.
  m.def("basic_op_forward", [](BasicOperation& op, OperationContext& ctx, const at::Tensor& x) {
    py::gil_scoped_release no_gil;
    return op.op_forward(ctx, x, forward_args_for(x));
  });
  m.def("basic_op_backward", [](BasicOperation& op, OperationContext& ctx, const at::Tensor& dy) {
    py::gil_scoped_release no_gil;
    return op.op_backward(ctx, dy);
  });
}

}  // namespace fusible::python

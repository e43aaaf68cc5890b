// Entry points of the binding files (one job each), called from module.cpp, and the few helpers
// they share.
#pragma once

#include <fusible/ops/operation_context.h>
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace fusible::python {

void bind_context(pybind11::module_& m);       // OperationContext
void bind_ops(pybind11::module_& m);           // the built-in operations
void bind_fuser(pybind11::module_& m);         // OperationFuser and Sequential
void bind_python_ops(pybind11::module_& m);    // ops and fused ops written in Python
void bind_fusions(pybind11::module_& m);       // the fusion registry
void bind_quantization(pybind11::module_& m);  // FP8 autocast state, Quantize

/// Drops a Python reference from C++ code that may run without the GIL (autograd threads) or after
/// the interpreter has shut down (then the reference is leaked rather than touched).
void release_with_gil(pybind11::object obj);

/// A tensor, or an undefined tensor for None; `what` names the value in the TypeError.
at::Tensor tensor_or_undefined(const pybind11::handle& obj, const std::string& what);

/// A context as a Python object that keeps it alive (shared with the fuser call that made it).
pybind11::object context_object(ops::OperationContext* ctx);
/// context_object of each.
pybind11::list context_list(const std::vector<ops::OperationContext*>& ctxs);

}  // namespace fusible::python

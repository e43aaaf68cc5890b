// Entry points of the binding files, called from module.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace fusible::python {

void bind_ops(pybind11::module_& m);
void bind_fuser(pybind11::module_& m);
void bind_python_ops(pybind11::module_& m);

}  // namespace fusible::python

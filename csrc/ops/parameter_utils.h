// Helpers shared by ops that own parameters: where parameters live by default, input checks against
// them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <optional>

namespace fusible::ops {

/// te.ops' default: parameters on the current CUDA device when CUDA is available, else CPU;
/// float32 unless a dtype is given. device "meta" defers allocation.
c10::TensorOptions param_options(std::optional<c10::Device> device,
                                 std::optional<at::ScalarType> dtype);

/// Checks that x is floating and on the parameter's device (meta parameters are materialized
/// before any op runs, so they never reach this check).
void check_input_against_param(const char* op, const at::Tensor& x, const at::Tensor& param);

/// Checks that a call's parameter has the op's declared shape (a swapped-in tensor may not).
void check_param_shape(const char* op, const char* name, const at::Tensor& param,
                       c10::IntArrayRef expected);

/// Where reset_parameters() puts meta parameters: the current CUDA device when CUDA is available,
/// else CPU.
c10::Device default_parameter_device();

/// Makes `param` take `value`'s storage, sizes, dtype and device while staying the same tensor
/// object (same TensorImpl: same autograd leaf, same Python Parameter). Unlike set_data this also
/// works from the meta device. Drops a gradient and gradient accumulator that no longer match.
void assign_in_place_(const at::Tensor& param, const at::Tensor& value);

/// Materializes a meta parameter in place on `device` (uninitialized; the caller initializes).
void materialize_(const at::Tensor& param, c10::Device device);

/// Uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch.nn.Linear's kaiming_uniform(a=sqrt(5)).
void init_linear_weight_(const at::Tensor& weight);

}  // namespace fusible::ops

// pybind11 classes for the C++ operations. The Python package wraps each in a torch.nn.Module.
#include <fusible/fusible.h>
#include <fusible/ops/call_buffers.h>
#include <fusible/ops/parameter_utils.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bindings.h"

namespace py = pybind11;

namespace fusible::python {

using namespace fusible::ops;
using OptDevice = std::optional<c10::Device>;
using OptDtype = std::optional<at::ScalarType>;

namespace {

// (name, tensor) for the op's own parameters, in registration order.
std::vector<std::pair<std::string, at::Tensor>> own_parameters(FusibleOperation& op) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : op.named_parameters(/*recurse=*/false)) {
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

// A CallBuffersGuard Python holds while a call runs (release() ends it on the same thread).
struct PyCallBuffers {
  std::unique_ptr<CallBuffersGuard> guard;
};

// te.ops' cache_quantized_input on an activation class.
template <typename Class>
void bind_quantized_input_cache(Class& cls) {
  using Op = typename Class::type;
  cls.def_property(
      "cache_quantized_input", [](const Op& op) { return op.caches_quantized_input(); },
      [](Op& op, bool on) { op.set_cache_quantized_input(on); });
}

}  // namespace

void bind_ops(py::module_& m) {
  py::class_<FusibleOperation, std::shared_ptr<FusibleOperation>>(m, "FusibleOperation",
                                                                  py::dynamic_attr())
      .def_property_readonly("type_name", &FusibleOperation::type_name)
      .def_property_readonly("is_fused", &FusibleOperation::is_fused)
      .def("get_basic_ops", &FusibleOperation::basic_ops)
      .def("own_parameters", &own_parameters)
      .def("reset_parameters", &FusibleOperation::reset_parameters)
      .def("train", [](FusibleOperation& op, bool on) { op.train(on); })
      .def_property_readonly("training", &FusibleOperation::is_training);

  // te.ops' op_kwargs buffers of a built-in op (ops/call_buffers.h) for the calls this thread
  // makes until release().
  py::class_<PyCallBuffers>(m, "_CallBuffers")
      .def(py::init([](const BasicOperation& op, std::optional<at::Tensor> output,
                       std::optional<at::Tensor> grad_input) {
             return PyCallBuffers{std::make_unique<CallBuffersGuard>(
                 &op,
                 CallBuffers{output.value_or(at::Tensor()), grad_input.value_or(at::Tensor())})};
           }),
           py::arg("op"), py::arg("output") = py::none(), py::arg("grad_input") = py::none())
      .def("release", [](PyCallBuffers& b) { b.guard.reset(); });

  m.def("assign_in_place_", &assign_in_place_, py::arg("param"), py::arg("value"),
        "Makes param take value's data while staying the same tensor object (meta included).");

  py::class_<BasicOperation, FusibleOperation, std::shared_ptr<BasicOperation>>(m, "BasicOperation")
      .def("adopt_parameters", &BasicOperation::adopt_parameters)
      .def("set_extra_output_channel",
           [](BasicOperation& op, int64_t index, std::optional<std::string> channel,
              bool output_to_caller) {
             op.set_extra_output_channel(index, std::move(channel), output_to_caller);
           })
      .def("set_extra_input_channel",
           [](BasicOperation& op, int64_t index, std::optional<std::string> channel) {
             op.set_extra_input_channel(index, std::move(channel));
           })
      .def_property_readonly("channels_locked", &BasicOperation::channels_locked)
      // A sequence-parallel replicated parameter's gradient summed over (group, size, rank);
      // None: no reduction.
      .def(
          "set_param_grad_reduction",
          [](BasicOperation& op, std::optional<std::tuple<std::string, int64_t, int64_t>> group) {
            std::optional<ProcessGroupSpec> spec;
            if (group)
              spec =
                  ProcessGroupSpec{std::get<0>(*group), std::get<1>(*group), std::get<2>(*group)};
            op.set_param_grad_reduction(std::move(spec));
          },
          py::arg("group"))
      .def_property_readonly(
          "param_grad_reduction",
          [](const BasicOperation& op) -> std::optional<std::tuple<std::string, int64_t, int64_t>> {
            const auto& g = op.param_grad_reduction();
            if (!g) return std::nullopt;
            return std::make_tuple(g->name, g->size, g->rank);
          })
      .def("extra_input_channels", &BasicOperation::extra_input_channels)
      .def("extra_output_channels",
           [](const BasicOperation& op) {
             py::list out;
             for (const auto& c : op.extra_output_channels())
               out.append(py::make_tuple(c.name, c.to_caller));
             return out;
           })
      .def_property_readonly("num_extra_inputs", &BasicOperation::num_extra_inputs)
      .def_property_readonly("num_extra_outputs", &BasicOperation::num_extra_outputs);
  py::class_<FusedOperation, FusibleOperation, std::shared_ptr<FusedOperation>>(m,
                                                                                "FusedOperation");

  py::class_<Identity, BasicOperation, std::shared_ptr<Identity>>(m, "Identity").def(py::init<>());
  py::class_<Reshape, BasicOperation, std::shared_ptr<Reshape>>(m, "Reshape")
      .def(py::init<std::vector<int64_t>>());
  py::class_<ConstantScale, BasicOperation, std::shared_ptr<ConstantScale>>(m, "ConstantScale")
      .def(py::init<double>());
  py::class_<Bias, BasicOperation, std::shared_ptr<Bias>>(m, "Bias").def(
      py::init<int64_t, OptDevice, OptDtype>());
  py::class_<BasicLinear, BasicOperation, std::shared_ptr<BasicLinear>>(m, "BasicLinear")
      .def(
          py::init([](int64_t in, int64_t out, OptDevice device, OptDtype dtype, std::string mode,
                      std::string group, int64_t size, int64_t rank, bool sequence_parallel) {
            return std::make_shared<BasicLinear>(
                in, out, device, dtype,
                TensorParallel{std::move(mode), {std::move(group), size, rank}, sequence_parallel});
          }),
          py::arg("in_features"), py::arg("out_features"), py::arg("device") = py::none(),
          py::arg("dtype") = py::none(), py::arg("mode") = "", py::arg("group") = "",
          py::arg("group_size") = 1, py::arg("rank") = 0, py::arg("sequence_parallel") = false)
      // "" (none), "column" or "row", after te.ops' canonicalization (one process: none).
      .def_property_readonly("tensor_parallel_mode",
                             [](const BasicLinear& op) { return op.tensor_parallel().mode; })
      // The keywords that rebuild this op's tensor parallelism ({} without).
      .def_property_readonly("tensor_parallel_args",
                             [](const BasicLinear& op) {
                               const auto& tp = op.tensor_parallel();
                               py::dict out;
                               if (tp.mode.empty()) return out;
                               out["mode"] = tp.mode;
                               out["group"] = tp.group.name;
                               out["group_size"] = tp.group.size;
                               out["rank"] = tp.group.rank;
                               out["sequence_parallel"] = tp.sequence_parallel;
                               return out;
                             })
      .def_property_readonly("local_in_features", &BasicLinear::in_features)
      .def_property_readonly("local_out_features", &BasicLinear::out_features)
      // target() -> (weight.main_grad, overwrite); result() -> the weight's gradient for autograd,
      // or None. target None: off.
      .def(
          "set_main_grad_hook",
          [](BasicLinear& op, py::object target, py::object result) {
            if (target.is_none()) return op.set_main_grad_hook(std::nullopt);
            op.set_main_grad_hook(
                MainGrad{target.cast<std::function<std::pair<at::Tensor, bool>()>>(),
                         result.cast<std::function<std::optional<at::Tensor>()>>()});
          },
          py::arg("target"), py::arg("result") = py::none())
      .def_property_readonly("accumulates_into_main_grad",
                             &BasicLinear::accumulates_into_main_grad);
  // Collectives: the process group as (c10d registry name, size, this rank).
  py::class_<Collective, BasicOperation, std::shared_ptr<Collective>>(m, "Collective");
  py::class_<AllGather, Collective, std::shared_ptr<AllGather>>(m, "AllGather")
      .def(py::init([](std::string group, int64_t size, int64_t rank) {
        return std::make_shared<AllGather>(ProcessGroupSpec{std::move(group), size, rank});
      }));
  py::class_<ReduceScatter, Collective, std::shared_ptr<ReduceScatter>>(m, "ReduceScatter")
      .def(py::init([](std::string group, int64_t size, int64_t rank) {
        return std::make_shared<ReduceScatter>(ProcessGroupSpec{std::move(group), size, rank});
      }));
  py::class_<AllReduce, Collective, std::shared_ptr<AllReduce>>(m, "AllReduce")
      .def(py::init([](std::string group, int64_t size, int64_t rank) {
        return std::make_shared<AllReduce>(ProcessGroupSpec{std::move(group), size, rank});
      }));
  py::class_<GroupedLinear, BasicOperation, std::shared_ptr<GroupedLinear>>(m, "GroupedLinear")
      .def(py::init<int64_t, int64_t, int64_t, bool, OptDevice, OptDtype, bool, bool, bool>())
      // target(i) -> (weight i's main_grad, overwrite); result(i) -> weight i's gradient for
      // autograd, or None. target None: off.
      .def(
          "set_main_grad_hook",
          [](GroupedLinear& op, py::object target, py::object result) {
            if (target.is_none()) return op.set_main_grad_hook(std::nullopt);
            op.set_main_grad_hook(GroupedLinear::MainGrad{
                target.cast<std::function<std::pair<at::Tensor, bool>(int64_t)>>(),
                result.cast<std::function<std::optional<at::Tensor>(int64_t)>>()});
          },
          py::arg("target"), py::arg("result") = py::none());
  py::class_<LayerNorm, BasicOperation, std::shared_ptr<LayerNorm>>(m, "LayerNorm")
      .def(py::init<std::vector<int64_t>, double, OptDevice, OptDtype, bool>());
  py::class_<RMSNorm, BasicOperation, std::shared_ptr<RMSNorm>>(m, "RMSNorm")
      .def(py::init<std::vector<int64_t>, double, OptDevice, OptDtype, bool>());
  py::class_<L2Normalization, BasicOperation, std::shared_ptr<L2Normalization>>(m,
                                                                                "L2Normalization")
      .def(py::init<double>());
  py::class_<ElementwiseActivation, BasicOperation, std::shared_ptr<ElementwiseActivation>>
      elementwise(m, "ElementwiseActivation");
  elementwise.def(py::init<std::string, std::string>());
  bind_quantized_input_cache(elementwise);
  py::class_<GatedActivation, BasicOperation, std::shared_ptr<GatedActivation>> gated(
      m, "GatedActivation");
  gated.def(py::init<std::string, std::string, int64_t>());
  bind_quantized_input_cache(gated);
  // The concrete classes, so that a fusion matching e.g. GELU by type sees Python-built ones.
#define FUSIBLE_BIND_ACTIVATION(Name, Base) \
  py::class_<Name, Base, std::shared_ptr<Name>>(m, #Name).def(py::init<>());
#define FUSIBLE_BIND_GATED(Name) \
  py::class_<Name, GatedActivation, std::shared_ptr<Name>>(m, #Name).def(py::init<int64_t>());
  FUSIBLE_BIND_ACTIVATION(GELU, ElementwiseActivation)
  FUSIBLE_BIND_ACTIVATION(QGELU, ElementwiseActivation)
  FUSIBLE_BIND_ACTIVATION(ReLU, ElementwiseActivation)
  FUSIBLE_BIND_ACTIVATION(SReLU, ElementwiseActivation)
  FUSIBLE_BIND_ACTIVATION(SiLU, ElementwiseActivation)
  FUSIBLE_BIND_GATED(GLU)
  FUSIBLE_BIND_GATED(GEGLU)
  FUSIBLE_BIND_GATED(QGEGLU)
  FUSIBLE_BIND_GATED(ReGLU)
  FUSIBLE_BIND_GATED(SReGLU)
  FUSIBLE_BIND_GATED(SwiGLU)
#undef FUSIBLE_BIND_ACTIVATION
#undef FUSIBLE_BIND_GATED
  py::class_<ParamGatedActivation, BasicOperation, std::shared_ptr<ParamGatedActivation>>
      param_gated(m, "ParamGatedActivation");
  bind_quantized_input_cache(param_gated);
  py::class_<ClampedSwiGLU, ParamGatedActivation, std::shared_ptr<ClampedSwiGLU>>(m,
                                                                                  "ClampedSwiGLU")
      .def(py::init<double, double, double, int64_t>());
  py::class_<SiTUGLU, ParamGatedActivation, std::shared_ptr<SiTUGLU>>(m, "SiTUGLU")
      .def(py::init<double, double, int64_t>());
  py::class_<RowScaledActivation, BasicOperation, std::shared_ptr<RowScaledActivation>>(
      m, "RowScaledActivation");
  py::class_<ScaledSwiGLU, RowScaledActivation, std::shared_ptr<ScaledSwiGLU>>(m, "ScaledSwiGLU")
      .def(py::init<int64_t>());
  py::class_<ScaledSiTUGLU, RowScaledActivation, std::shared_ptr<ScaledSiTUGLU>>(m, "ScaledSiTUGLU")
      .def(py::init<double, double, int64_t>());
  py::class_<ScaledClampedQGeGLU, RowScaledActivation, std::shared_ptr<ScaledClampedQGeGLU>>(
      m, "ScaledClampedQGeGLU")
      .def(py::init<double, double, double, int64_t>());
  py::class_<ScaledSReLU, RowScaledActivation, std::shared_ptr<ScaledSReLU>>(m, "ScaledSReLU")
      .def(py::init<>());
  py::class_<ScaledTanhSReLU, RowScaledActivation, std::shared_ptr<ScaledTanhSReLU>>(
      m, "ScaledTanhSReLU")
      .def(py::init<double>());
  py::class_<AddExtraInput, BasicOperation, std::shared_ptr<AddExtraInput>>(m, "AddExtraInput")
      .def(py::init<bool>());
  py::class_<MakeExtraOutput, BasicOperation, std::shared_ptr<MakeExtraOutput>>(m,
                                                                                "MakeExtraOutput")
      .def(py::init<bool>());
  py::class_<Dropout, BasicOperation, std::shared_ptr<Dropout>>(m, "Dropout")
      .def(py::init<double>());
  // The built-in fused ops, as plans hold them (fusible.ops.fused wraps them for Python).
#define FUSIBLE_BIND_FUSED(Name) py::class_<Name, FusedOperation, std::shared_ptr<Name>>(m, #Name);
  FUSIBLE_BIND_FUSED(ForwardLinearBiasActivation)
  FUSIBLE_BIND_FUSED(ForwardLinearBiasAdd)
  FUSIBLE_BIND_FUSED(ForwardLinearScaleAdd)
  FUSIBLE_BIND_FUSED(BackwardLinearAdd)
  FUSIBLE_BIND_FUSED(BackwardLinearScale)
  FUSIBLE_BIND_FUSED(BackwardActivationBias)
  FUSIBLE_BIND_FUSED(BackwardLinearActivationBias)
  FUSIBLE_BIND_FUSED(BackwardAddRMSNorm)
  FUSIBLE_BIND_FUSED(BackwardAddLayerNorm)
  FUSIBLE_BIND_FUSED(GroupedMLP_GroupedGEMMGLU)
#undef FUSIBLE_BIND_FUSED
  py::class_<Linear, FusedOperation, std::shared_ptr<Linear>>(m, "Linear")
      .def(py::init([](int64_t in, int64_t out, bool bias, OptDevice device, OptDtype dtype,
                       std::string mode, std::string group, int64_t size, int64_t rank,
                       bool sequence_parallel, const std::string& row_parallel_bias) {
             TORCH_CHECK_VALUE(row_parallel_bias == "replicated" || row_parallel_bias == "summand",
                               "Linear: expected row_parallel_bias \"replicated\" or \"summand\", "
                               "got \"",
                               row_parallel_bias, "\"");
             return std::make_shared<Linear>(
                 in, out, bias, device, dtype,
                 TensorParallel{std::move(mode), {std::move(group), size, rank}, sequence_parallel},
                 row_parallel_bias == "summand" ? RowParallelBias::kPerRankSummand
                                                : RowParallelBias::kReplicated);
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true,
           py::arg("device") = py::none(), py::arg("dtype") = py::none(), py::arg("mode") = "",
           py::arg("group") = "", py::arg("group_size") = 1, py::arg("rank") = 0,
           py::arg("sequence_parallel") = false, py::arg("row_parallel_bias") = "replicated")
      .def(py::init<std::shared_ptr<BasicLinear>, std::shared_ptr<Bias>,
                    std::shared_ptr<BasicOperation>>(),
           py::arg("linear"), py::arg("bias") = nullptr, py::arg("collective") = nullptr)
      .def_property_readonly("linear_op", &Linear::linear_op)
      .def_property_readonly("bias_op", &Linear::bias_op)
      .def_property_readonly("collective_op", &Linear::collective_op);
}

}  // namespace fusible::python

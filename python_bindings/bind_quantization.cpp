// pybind11 bindings for the FP8 autocast state (fusible.autocast is Python; the state is C++'s,
// per thread) and the Quantize op.
#include <fusible/fusible.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>

#include "bindings.h"
#include "kernels/fp8/fp8.h"
#include "kernels/fp8/fp8_support.h"
#include "ops/fp8_state_rollback.h"

namespace py = pybind11;

namespace fusible::python {

using ops::Fp8Autocast;
using ops::Fp8Recipe;

void bind_quantization(py::module_& m) {
  py::class_<Fp8Recipe, std::shared_ptr<Fp8Recipe>>(m, "Fp8Recipe")
      .def(py::init([](std::string kind, std::string forward_format, std::string backward_format,
                       double margin, int64_t amax_history_len, std::string amax_compute_algo,
                       int64_t x_block_dim, int64_t w_block_dim, int64_t grad_block_dim,
                       int64_t min_tokens,
                       std::optional<std::tuple<std::string, int64_t, int64_t>> amax_group,
                       const std::string& amax_device) {
             ops::ProcessGroupSpec group;
             if (amax_group) {
               group = {std::get<0>(*amax_group), std::get<1>(*amax_group),
                        std::get<2>(*amax_group)};
             }
             return std::make_shared<Fp8Recipe>(Fp8Recipe{
                 std::move(kind), std::move(forward_format), std::move(backward_format), margin,
                 amax_history_len, std::move(amax_compute_algo), x_block_dim, w_block_dim,
                 grad_block_dim, min_tokens, std::move(group), c10::Device(amax_device)});
           }),
           py::arg("kind"), py::arg("forward_format"), py::arg("backward_format"),
           py::arg("margin"), py::arg("amax_history_len") = 1024,
           py::arg("amax_compute_algo") = "max", py::arg("x_block_dim") = 1,
           py::arg("w_block_dim") = 2, py::arg("grad_block_dim") = 1, py::arg("min_tokens") = 0,
           py::arg("amax_group") = py::none(), py::arg("amax_device") = "cpu")
      .def_readonly("amax_history_len", &Fp8Recipe::amax_history_len)
      .def_readonly("amax_compute_algo", &Fp8Recipe::amax_compute_algo)
      .def_readonly("kind", &Fp8Recipe::kind)
      .def_readonly("forward_format", &Fp8Recipe::forward_format)
      .def_readonly("backward_format", &Fp8Recipe::backward_format)
      .def_readonly("margin", &Fp8Recipe::margin)
      .def_readonly("min_tokens", &Fp8Recipe::min_tokens)
      .def_property_readonly("amax_group", [](const Fp8Recipe& r) -> py::object {
        const auto& g = r.amax_reduction_group;
        if (g.size <= 1) return py::none();
        return py::make_tuple(g.name, g.size, g.rank);
      });
  // Whether an autocast entered now is the one that reduces amaxes (ops::starts_amax_reduction).
  m.def("_starts_amax_reduction", [](const std::shared_ptr<Fp8Recipe>& recipe) {
    return ops::starts_amax_reduction(ops::fp8_autocast(), {recipe != nullptr, recipe});
  });
  // DelayedScaling's amax reduction across ranks (a collective; ops/amax_reduction.h): at
  // fusible.autocast's entry and exit.
  m.def(
      "_reduce_delayed_amaxes",
      [](const std::shared_ptr<Fp8Recipe>& recipe) { ops::reduce_delayed_amaxes(*recipe); },
      py::arg("recipe"), py::call_guard<py::gil_scoped_release>());
  // (enabled, recipe or None) in, the previous pair out: Python's autocast restores it on exit.
  m.def(
      "_exchange_fp8_autocast",
      [](bool enabled, std::shared_ptr<Fp8Recipe> recipe) {
        auto prev = ops::exchange_fp8_autocast(Fp8Autocast{enabled, std::move(recipe)});
        return std::make_pair(prev.enabled, std::const_pointer_cast<Fp8Recipe>(prev.recipe));
      },
      py::arg("enabled"), py::arg("recipe"));
  // The key a compiled call carries for a recipe (ops::recipe_key; "" for None).
  m.def("_fp8_recipe_key",
        [](const std::shared_ptr<Fp8Recipe>& recipe) { return ops::recipe_key(recipe.get()); });
  // fusible.checkpoint: an activation checkpoint's forward records the delayed casts it makes
  // (with the scales it casts with); its recompute replays them (the same scales, no history
  // update). Each scope is a context manager holding its C++ guard.
  py::class_<ops::Fp8Record, std::shared_ptr<ops::Fp8Record>>(m, "_Fp8Record").def(py::init<>());
  struct RecordScope {
    std::shared_ptr<ops::Fp8Record> record;
    std::unique_ptr<ops::Fp8RecordGuard> guard;
  };
  py::class_<RecordScope>(m, "_Fp8RecordScope")
      .def(py::init([](std::shared_ptr<ops::Fp8Record> r) { return RecordScope{std::move(r)}; }))
      .def("__enter__",
           [](RecordScope& s) { s.guard = std::make_unique<ops::Fp8RecordGuard>(s.record); })
      .def("__exit__", [](RecordScope& s, const py::args&) { s.guard.reset(); });
  struct ReplayScope {
    std::shared_ptr<ops::Fp8Record> record;
    std::unique_ptr<ops::Fp8ReplayGuard> guard;
  };
  py::class_<ReplayScope>(m, "_Fp8ReplayScope")
      .def(py::init([](std::shared_ptr<ops::Fp8Record> r) { return ReplayScope{std::move(r)}; }))
      .def("__enter__", [](ReplayScope& s) { s.guard = s.record->replay(); })
      .def("__exit__", [](ReplayScope& s, const py::args&) { s.guard.reset(); });
  m.def("_fp8_autocast_state", [] {
    const auto& a = ops::fp8_autocast();
    return std::make_pair(a.enabled, std::const_pointer_cast<Fp8Recipe>(a.recipe));
  });

  // An op's delayed-scaling state as {"forward": [(amax_history, scale)], "backward": [...]}
  // (None before any), for its checkpoint's _extra_state; set takes the same (None clears).
  m.def("_fp8_state", [](ops::BasicOperation& op) -> py::object {
    const auto& s = op.fp8_state();
    if (!s) return py::none();
    py::dict out;
    for (const auto& [name, states] :
         {std::pair{"forward", &s->forward}, std::pair{"backward", &s->backward}}) {
      py::list l;
      for (const auto& d : *states) l.append(py::make_tuple(d.amax_history, d.scale));
      out[name] = l;
    }
    // The formats the scales are for, as their largest values (a tensor, as the rest of a state
    // dict: torch.testing.assert_close compares it); a recipe of another format rescales them.
    if (!s->forward_format.empty()) {
      out["fp8_max"] = at::tensor({kernels::fp8_max("FP8 state", s->forward_format),
                                   kernels::fp8_max("FP8 state", s->backward_format)},
                                  at::kDouble);
    }
    return out;
  });
  m.def("_set_fp8_state", [](ops::BasicOperation& op, const py::object& state) {
    if (state.is_none()) return op.set_fp8_state(nullptr);
    auto s = std::make_shared<ops::Fp8OpState>();
    for (auto [name, states] :
         {std::pair{"forward", &s->forward}, std::pair{"backward", &s->backward}}) {
      for (const auto& item : state[name]) {
        const auto pair = item.cast<std::pair<at::Tensor, at::Tensor>>();
        TORCH_CHECK_VALUE(pair.first.dim() == 1 && pair.second.numel() == 1, op.type_name(),
                          ": bad FP8 state in a checkpoint (expected an amax history and a ",
                          "one-element scale)");
        // The scale divides every cast: a NaN, infinite, zero or negative one gives garbage
        // silently (the update never writes one: it keeps the old scale for such an amax).
        // (A meta state, a deferred op's copy, has no values to check.)
        const float scale = pair.second.is_meta()
                                ? 1.f
                                : pair.second.detach().to(at::kFloat).reshape({}).item<float>();
        TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.f, op.type_name(),
                          ": bad FP8 state in a checkpoint (", name,
                          " scale must be a finite positive number, got ", scale, ")");
        states->push_back({pair.first.detach().to(at::kFloat).clone(),
                           pair.second.detach().to(at::kFloat).reshape({1}).clone()});
      }
    }
    // Absent in checkpoints written before fusible recorded them: unknown, never rescaled.
    if (state.contains("fp8_max")) {
      const auto fmax = state["fp8_max"].cast<at::Tensor>().to(at::kDouble).contiguous();
      const auto format_of = [&](int64_t i) -> std::string {
        const double v = fmax.numel() == 2 ? fmax.data_ptr<double>()[i] : 0.0;
        TORCH_CHECK_VALUE(v == 448.0 || v == 57344.0, op.type_name(),
                          ": bad FP8 state in a checkpoint (fp8_max ", fmax,
                          " is not E4M3's 448 or E5M2's 57344)");
        return v == 448.0 ? "e4m3" : "e5m2";
      };
      s->forward_format = format_of(0);
      s->backward_format = format_of(1);
    }
    const auto [n_fwd, n_bwd] = op.num_quantizers();
    TORCH_CHECK_VALUE(static_cast<int64_t>(s->forward.size()) == n_fwd &&
                          static_cast<int64_t>(s->backward.size()) == n_bwd,
                      op.type_name(), ": a checkpoint's FP8 state has ", s->forward.size(), " / ",
                      s->backward.size(), " quantizers, the op uses ", n_fwd, " / ", n_bwd);
    // Into the op's own tensors when the layout matches (as parameters load: a captured CUDA
    // graph keeps seeing them); else the loaded state replaces it.
    const auto& cur = op.fp8_state();
    const auto same = [](const std::vector<ops::DelayedScaling>& a,
                         const std::vector<ops::DelayedScaling>& b) {
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].amax_history.sizes().equals(b[i].amax_history.sizes())) return false;
      }
      return true;
    };
    if (cur && same(cur->forward, s->forward) && same(cur->backward, s->backward)) {
      const at::NoGradGuard no_grad;
      for (auto [to, from] :
           {std::pair{&cur->forward, &s->forward}, std::pair{&cur->backward, &s->backward}}) {
        for (size_t i = 0; i < to->size(); ++i) {
          (*to)[i].amax_history.copy_((*from)[i].amax_history);
          (*to)[i].scale.copy_((*from)[i].scale);
        }
      }
      cur->forward_format = s->forward_format;
      cur->backward_format = s->backward_format;
      return;
    }
    op.set_fp8_state(std::move(s));
  });

  // Which FP8 GEMMs this GPU runs (fusible.fp8_available() and friends; the tests' override).
  m.def("_fp8_gemm_support", &kernels::fp8_gemm_support, py::arg("major"), py::arg("minor"),
        py::arg("block"));
  m.def("_cuda_capability", [] { return kernels::cuda_capability(-1); });
  m.def("_set_cuda_capability_override", &kernels::set_cuda_capability_override, py::arg("major"),
        py::arg("minor"));
  m.def("_fp8_amax_handoff", &ops::fp8_amax_handoff);
  m.def("_set_fp8_amax_handoff", &ops::set_fp8_amax_handoff, py::arg("on"));
  m.def("_fp8_state_rollback", &ops::Fp8StateRollback::enabled);
  m.def("_set_fp8_state_rollback", &ops::Fp8StateRollback::set_enabled, py::arg("on"));
  m.def("_fp8_cast_one_launch", &kernels::fp8_cast_one_launch);
  m.def("_set_fp8_cast_one_launch", &kernels::set_fp8_cast_one_launch, py::arg("on"));
  m.def("_num_quantizers", [](ops::BasicOperation& op) { return op.num_quantizers(); });
  m.def("_fp8_recipe", [](ops::BasicOperation& op) {
    return std::const_pointer_cast<Fp8Recipe>(op.fp8_recipe());
  });
  m.def("_reset_fp8_state",
        [](ops::BasicOperation& op, std::shared_ptr<Fp8Recipe> recipe, c10::Device device) {
          op.reset_fp8_state(std::move(recipe), device);
        });

  py::class_<ops::Quantize, ops::BasicOperation, std::shared_ptr<ops::Quantize>>(m, "Quantize")
      .def(py::init<bool, bool>(), py::arg("forward"), py::arg("backward"))
      .def_property_readonly("last_backward_scale", [](const ops::Quantize& q) -> py::object {
        const auto& s = q.last_backward_scale();
        return s.defined() ? py::cast(s) : py::none();
      });
}

}  // namespace fusible::python

// Per-call, per-basic-op state handed from an op's forward to its backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <memory>
#include <string>
#include <vector>

#include "ops/quantization.h"

namespace fusible::ops {

/// max |t| of one tensor t, as the kernel that wrote t computed it (FP8 current scaling: the cast
/// of t then needs no amax pass of its own).
struct ProducedAmax {
  at::Tensor of;    // t
  at::Tensor amax;  // [1] fp32
  /// The amax where `t` is the very tensor it was computed of; else undefined.
  at::Tensor for_tensor(const at::Tensor& t) const {
    return amax.defined() && t.is_same(of) ? amax : at::Tensor();
  }
};

/// An activation's output handed to the next op as act(pre), not computed (FP8: the next linear
/// casts act(pre) to FP8 in one pass; no tensor of the output is written or read). `of` stands
/// in for the output the fuser passes along: its shape, dtype and device, no data of its own
/// (one NaN, broadcast), so a reader that skipped the resolution would see NaN, not numbers.
struct DeferredActivation {
  at::Tensor of, pre;
  std::string act;  // an activation_fwd kind
  /// Whether t is the stand-in of this deferred output.
  bool for_tensor(const at::Tensor& t) const { return pre.defined() && t.is_same(of); }
};

struct MainGradCall;  // ops/basic/basic_linear.h

/// One per basic op per fuser call. The fuser moves every context's `to_save` into one flat
/// save_for_backward and hands them back as `saved_tensors` before the backward runs.
struct OperationContext : std::enable_shared_from_this<OperationContext> {
  /// Tensors the backward needs (set with save_for_backward during the forward). The fuser keeps
  /// those the caller cannot reach (made inside the call) itself and frees them early; the rest
  /// go through autograd, which checks their versions. An op that saves a tensor from elsewhere
  /// (a buffer, a tensor kept on the op) sets check_saved_versions so all of its go through
  /// autograd; ops written in Python always do.
  std::vector<at::Tensor> to_save;
  bool check_saved_versions = false;
  /// The saved tensors, restored for the backward.
  std::vector<at::Tensor> saved_tensors;
  /// Set once the fuser has moved to_save into saved_tensors (at the end of the forward): before,
  /// saved_tensors holds nothing an op may read.
  bool saved_for_backward = false;
  /// This call's parameters of the op, in op_parameters() order: ops compute with these, never
  /// with a tensor captured earlier. Set for the forward only.
  std::vector<at::Tensor> params;
  /// Whether each of those parameters needs a gradient (kept for the backward).
  std::vector<bool> param_requires_grad;
  /// Whether this op's backward will run.
  bool requires_grad = false;
  /// Whether the gradient of this op's input is needed.
  bool input_requires_grad = false;
  /// Whether each extra input (in slot order) needs a gradient.
  std::vector<bool> extra_input_requires_grad;
  /// Whether each extra input (in slot order) is a positional extra tensor of the caller, the one
  /// kind an in-place op may write into (te.ops' AddExtraInput(in_place=True)). A channel value is
  /// not: other consumers may read it, and one made in an earlier fuser group may be the caller's
  /// x (MakeExtraOutput hands out its input itself) or a tensor saved for backward.
  std::vector<bool> extra_input_writable;
  /// Tensors the backward reads through a view of another (GroupedLinear's groups after the
  /// first, read through group 0's), with their versions at the forward: autograd checks only
  /// the viewed tensor's, so the op checks these (check_read_versions) before its backward.
  std::vector<std::pair<at::Tensor, int64_t>> read_versions;
  void check_read_versions(const char* op) const {
    for (const auto& [t, version] : read_versions) {
      TORCH_CHECK(t._version() == version, op,
                  ": one of the variables needed for gradient computation has been modified by "
                  "an inplace operation: a parameter of shape ",
                  t.sizes(), " is at version ", t._version(), "; expected version ", version,
                  " instead");
    }
  }
  /// Whether the call records an autograd node (some op's backward runs). Without one, an
  /// in-place op may write into a view too: no history is rebased.
  bool call_records_node = true;
  /// Dtype of the input as it arrived (its gradient goes back in this dtype).
  at::ScalarType input_dtype = at::kFloat;
  /// Dtype the op computed in (parameter dtype, or autocast's).
  at::ScalarType compute_dtype = at::kFloat;
  /// The FP8 casts the forward made (off outside an FP8 autocast); the backward casts with the
  /// same recipe.
  Fp8Cast fp8;
  /// The amax handoff between neighbours under FP8 current scaling (set by the fuser; a producer
  /// that cannot compute the amax in its kernel ignores the request):
  /// - want_output_amax: the next op casts this op's output per tensor; put max |output| in
  ///   output_amax. The fuser hands it to the next op's input_amax.
  /// - want_grad_input_amax: the same for the gradient of the input, in the backward
  ///   (grad_input_amax, handed to the previous op's grad_output_amax).
  /// - takes_grad_output_amax: set by an op's forward whose backward casts the output gradient
  ///   per tensor, so the fuser asks the op after it.
  /// A consumer uses an amax only for the very tensor it was computed of (ProducedAmax).
  bool want_output_amax = false, want_grad_input_amax = false, takes_grad_output_amax = false;
  ProducedAmax output_amax, input_amax, grad_input_amax, grad_output_amax;
  /// The deferred-activation handoff under FP8 delayed scaling (set by the fuser where the next op
  /// takes_input_act): want_output_act asks an activation to return a stand-in and put act(pre)
  /// in output_act; the fuser moves it to the next op's input_act, which must resolve it.
  bool want_output_act = false;
  DeferredActivation output_act, input_act;
  /// Set by the forward of a linear whose weight gradient goes into a main_grad: its backward's
  /// wgrad accumulates there (ops/basic/basic_linear.h).
  std::shared_ptr<const MainGradCall> main_grad;
  /// Set by a backward that summed its parameter gradients over param_grad_reduction()'s group
  /// itself (a linear's, into main_grad): what it returns (te's dummy) is not reduced again.
  bool param_grads_reduced = false;
  /// Shape of the input as it arrived (Reshape's backward needs it).
  std::vector<int64_t> input_shape;
  /// Free-form op state that is not a tensor (scalars).
  c10::IValue state;
  /// State owned by a language binding (the Python attributes users set on a context).
  std::shared_ptr<void> binding_state;
  /// Set by the fuser for a backward that does not keep the graph: the op may drop a saved
  /// tensor as soon as it is done with it (release_saved), so its memory serves the next
  /// allocation.
  bool release_saved = false;

  /// Drops saved tensor i when the backward allows it (no retain_graph); a no-op otherwise.
  void release_saved_tensor(size_t i) {
    if (release_saved && i < saved_tensors.size()) saved_tensors[i] = at::Tensor();
  }

  void save_for_backward(std::vector<at::Tensor> tensors) { to_save = std::move(tensors); }

  /// Parameter i of this call; `op` names the op in the error.
  const at::Tensor& param(size_t i, const char* op) const {
    TORCH_CHECK(i < params.size(), op, ": expected parameter ", i,
                " among the call's parameters, got ", params.size(),
                " (run the op through an OperationFuser, which passes them)");
    return params[i];
  }
};

}  // namespace fusible::ops

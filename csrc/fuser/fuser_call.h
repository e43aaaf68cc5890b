// State of one fuser call, shared by its forward and its backward (kept alive by the autograd
// node).
#pragma once

#include <ATen/core/DimVector.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <vector>

#include "fuser/channel_routing.h"
#include "fuser/operation_fuser.h"
#include "ops/operation_context.h"

namespace fusible::fuser {

struct FuserCall : torch::CustomClassHolder {
  // Shared, immutable snapshots: a re-plan or re-route cannot change a pending backward.
  std::shared_ptr<const Plan> plan;
  std::shared_ptr<const Routing> routing;
  // One per basic op; shared, so a binding can hand them out for as long as its callers hold them.
  std::vector<std::shared_ptr<ops::OperationContext>> ctxs;
  int64_t first_backward = 0;  // first basic op whose backward runs
  bool input_requires_grad = false;
  std::shared_ptr<const ParamLayout> params;      // parameter positions
  std::vector<at::ScalarType> param_dtypes;       // the call's, per flat parameter (grads match)
  std::vector<std::shared_ptr<void>> keep_alive;  // see FusibleOperation::keep_alive
  // Where each context's saved tensors live (one entry per slot of its saved_tensors): >= 0, that
  // index of autograd's saved variables (tensors the caller can reach: inputs, parameters,
  // outputs, so autograd checks their versions); -1, held in the context itself (made inside the
  // forward and reachable by no one else), so the backward can free them op by op.
  std::vector<std::vector<int64_t>> saved_slots;
  // Shapes of the differentiable inputs, in run_backward's order: a gradient of another shape
  // (user code's backward) is an error, not something autograd sums away.
  std::vector<c10::DimVector> grad_shapes;
  // Per basic op, whether a forward step began at it: then its context's input_shape is exact
  // (a fused forward's inner ops have only defaults) and its input gradient must match it.
  std::vector<char> step_starts;
  // y's metadata, to make a zero gradient when only extra outputs were used.
  std::vector<int64_t> output_shape;
  at::TensorOptions output_options;
};

/// Runs the forward plan: returns [y, exported extra outputs].
std::vector<at::Tensor> run_forward(FuserCall& call, const at::Tensor& input,
                                    const std::vector<at::Tensor>& extra_inputs,
                                    const std::vector<at::Tensor>& external);

/// Runs the backward plan: returns [dx, one per parameter, one per public extra input, one per
/// external input]. A context with release_saved drops its saved tensors once its op's backward is
/// done (the graph is not kept for another backward).
std::vector<at::Tensor> run_backward(FuserCall& call, const std::vector<at::Tensor>& grad_outputs);

}  // namespace fusible::fuser

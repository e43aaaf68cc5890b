// GroupedLinear through the grouped GEMM kernels (kernels/grouped/grouped.h): the split sizes reach
// them as a tensor, so on CUDA nothing waits for the host.
#include "ops/basic/grouped_linear.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include "common/checks.h"
#include "kernels/dispatch.h"
#include "kernels/grouped/grouped.h"
#include "ops/call_buffers.h"
#include "ops/parameter_utils.h"

namespace fusible::ops {
namespace {

// count tensors of `shape` sharing one fresh buffer (slot i at offset i * numel): separate
// parameters that the grouped GEMM can still read as one [count, shape...] tensor.
std::vector<at::Tensor> slices_of_one_buffer(int64_t count, c10::IntArrayRef shape,
                                             const c10::TensorOptions& options) {
  std::vector<int64_t> full{count};
  full.insert(full.end(), shape.begin(), shape.end());
  const auto buffer = at::empty(full, options);
  const int64_t numel = c10::multiply_integers(shape);
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < count; ++i) {
    auto t = at::empty({0}, options);
    t.set_(buffer.storage(), i * numel, shape, c10::contiguous_strides(shape));
    out.push_back(t);
  }
  return out;
}

// Whether ts are contiguous slices laid one after another in one storage.
bool consecutive_slices(const std::vector<at::Tensor>& ts) {
  const auto& first = ts.front();
  if (!first.is_contiguous()) return false;
  for (size_t i = 1; i < ts.size(); ++i) {
    const auto& t = ts[i];
    if (!t.is_contiguous() || t.scalar_type() != first.scalar_type() ||
        !t.storage().is_alias_of(first.storage()) || t.sizes() != first.sizes() ||
        t.storage_offset() != first.storage_offset() + static_cast<int64_t>(i) * first.numel()) {
      return false;
    }
  }
  return true;
}

std::string param_name(const char* base, int64_t g, bool single) {
  return single ? std::string(base) : base + std::to_string(g);
}

// The split sizes on the host, checked against the rows (FP8 casts each group apart: it waits for
// the device's sizes, as te.ops, which takes them as a host list).
void check_split_sum(const std::vector<int64_t>& sizes, int64_t rows) {
  int64_t sum = 0;
  for (auto n : sizes) {
    TORCH_CHECK_VALUE(n >= 0, "GroupedLinear: expected non-negative split sizes, got ", n);
    sum += n;
  }
  TORCH_CHECK_VALUE(sum == rows, "GroupedLinear: expected split sizes summing to the input's ",
                    rows, " rows, got ", sum);
}

std::vector<int64_t> host_split_sizes(const at::Tensor& sizes, int64_t rows) {
  const auto host = sizes.to(at::kCPU, at::kLong).contiguous();  // a strided view read in order
  std::vector<int64_t> out(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  check_split_sum(out, rows);
  return out;
}

// Each group's rows of t [rows, k] cast by `cast(group, its rows)` -> (rowwise, columnwise)
// operands, concatenated; an empty group's rows are left as they are.
template <typename Cast>
std::pair<at::Tensor, at::Tensor> cast_groups(const at::Tensor& t,
                                              const std::vector<int64_t>& sizes, bool rowwise,
                                              bool columnwise, Cast&& cast) {
  std::vector<at::Tensor> rows, cols;
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const auto part = t.narrow(0, start, sizes[g]);
    start += sizes[g];
    if (sizes[g] == 0) {
      rows.push_back(part);
      cols.push_back(part);
      continue;
    }
    const GemmOperand o = cast(static_cast<int64_t>(g), part);
    if (rowwise) rows.push_back(o.rowwise);
    if (columnwise) cols.push_back(o.columnwise);
  }
  return {rowwise ? at::cat(rows) : at::Tensor(), columnwise ? at::cat(cols) : at::Tensor()};
}

}  // namespace

GroupedLinear::GroupedLinear(int64_t num_groups, int64_t in_features, int64_t out_features,
                             bool bias, std::optional<c10::Device> device,
                             std::optional<at::ScalarType> dtype, bool scale_bias,
                             bool single_grouped_weight, bool single_grouped_bias)
    : BasicOperation("GroupedLinear", /*num_extra_inputs=*/bias && scale_bias ? 2 : 1),
      num_groups_(num_groups),
      in_features_(in_features),
      out_features_(out_features),
      has_bias_(bias),
      scale_bias_(bias && scale_bias),
      single_weight_(single_grouped_weight),
      single_bias_(bias && single_grouped_bias) {
  TORCH_CHECK_VALUE(num_groups > 0, "GroupedLinear: expected num_groups > 0, got ", num_groups);
  TORCH_CHECK_VALUE(in_features > 0 && out_features > 0,
                    "GroupedLinear: expected positive in_features and out_features, got ",
                    in_features, " and ", out_features);
  const auto options = param_options(device, dtype);
  if (single_weight_) {
    register_parameter("weight", at::empty({num_groups, out_features, in_features}, options));
  } else {
    const auto ws = slices_of_one_buffer(num_groups, {out_features, in_features}, options);
    for (int64_t g = 0; g < num_groups; ++g)
      register_parameter("weight" + std::to_string(g), ws[g]);
  }
  if (single_bias_) {
    register_parameter("bias", at::empty({num_groups, out_features}, options));
  } else if (has_bias_) {
    const auto bs = slices_of_one_buffer(num_groups, {out_features}, options);
    for (int64_t g = 0; g < num_groups; ++g) register_parameter("bias" + std::to_string(g), bs[g]);
  }
  if (!options.device().is_meta()) reset_parameters();
}

bool GroupedLinear::materialize_meta_parameters(c10::Device device) {
  // Per-group parameters become slices of one buffer again (the grouped GEMM reads them in place).
  bool any = false;
  auto materialize_group = [&](const char* base, c10::IntArrayRef shape) {
    std::vector<at::Tensor> params;
    for (int64_t g = 0; g < num_groups_; ++g) {
      params.push_back(*parameters_.find(base + std::to_string(g)));
    }
    if (!params.front().is_meta()) return;
    const c10::InferenceMode not_inference(false);
    const auto slots =
        slices_of_one_buffer(num_groups_, shape, params.front().options().device(device));
    for (int64_t g = 0; g < num_groups_; ++g) assign_in_place_(params[g], slots[g]);
    any = true;
  };
  if (!single_weight_) materialize_group("weight", {out_features_, in_features_});
  if (has_bias_ && !single_bias_) materialize_group("bias", {out_features_});
  return BasicOperation::materialize_meta_parameters(device) || any;
}

void GroupedLinear::reset_parameters() {
  materialize_meta_parameters(default_parameter_device());
  const at::NoGradGuard no_grad;
  for (int64_t i = 0; i < num_weight_params(); ++i) {
    auto& w = *parameters_.find(param_name("weight", i, single_weight_));
    if (single_weight_) {
      for (int64_t g = 0; g < num_groups_; ++g) {
        auto w_g = w[g];
        init_linear_weight_(w_g);
      }
    } else {
      init_linear_weight_(w);
    }
  }
  for (int64_t i = 0; i < num_bias_params(); ++i) {
    parameters_.find(param_name("bias", i, single_bias_))->zero_();
  }
}

void GroupedLinear::set_main_grad_hook(std::optional<MainGrad> hook) {
  if (hook) {
    TORCH_CHECK_VALUE(hook->target && hook->result,
                      "GroupedLinear: set_main_grad_hook expects both target and result");
  }
  main_grad_ = hook ? std::make_shared<const MainGrad>(std::move(*hook)) : nullptr;
}

at::Tensor GroupedLinear::take_param_grad(size_t index, const at::Tensor& grad) {
  // Without a reduction param_grads already wrote main_grad: grad is autograd's. With one, the
  // summed gradient is added here.
  const auto i = static_cast<int64_t>(index);
  if (!main_grad_ || !param_grad_reduction() || i >= num_weight_params()) return grad;
  const auto [buffer, overwrite] = main_grad_->target(i);
  TORCH_CHECK(buffer.defined(), "GroupedLinear: the main_grad target returned no tensor");
  {
    const at::NoGradGuard no_grad;
    overwrite ? buffer.copy_(grad) : buffer.add_(grad);
  }
  return main_grad_->result(i).value_or(at::Tensor());
}

std::optional<std::vector<int64_t>> GroupedLinear::host_sizes_at_hand(const OperationContext& ctx,
                                                                      const Grad& grad) const {
  if (!grad.sizes.empty()) return grad.sizes;
  const auto& sizes = ctx.saved_tensors.at(0);
  if (!sizes.is_cpu()) return std::nullopt;
  return host_split_sizes(sizes, grad.wgrad.size(0));
}

void GroupedLinear::weight_grads_into(const Grad& grad, const at::Tensor& x,
                                      const std::vector<int64_t>& sizes,
                                      const MainGradBuffers& buffers) const {
  const auto& dy = grad.wgrad;
  int64_t start = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    const int64_t m = sizes[g];
    const auto& [buffer, overwrite] = buffers[g];
    if (buffer.defined()) {
      kernels::linear_wgrad_add_(buffer, dy.narrow(0, start, m), x.narrow(0, start, m), 1.0,
                                 overwrite ? 0.0 : 1.0);
    }
    start += m;
  }
}

void GroupedLinear::weight_grads_into_main_grad(const OperationContext& ctx, const Grad& grad,
                                                const at::Tensor& x,
                                                std::vector<at::Tensor>& grads) const {
  const int64_t nw = num_weight_params();
  std::vector<std::pair<at::Tensor, bool>> targets(nw);
  for (int64_t i = 0; i < nw; ++i) {
    if (!ctx.param_requires_grad.at(i)) continue;
    targets[i] = main_grad_->target(i);
    TORCH_CHECK(targets[i].first.defined(),
                "GroupedLinear: the main_grad target returned no tensor");
  }
  // Group g's buffer: its own parameter's main_grad, or slice g of the single grouped weight's.
  MainGradBuffers buffers(num_groups_);
  for (int64_t g = 0; g < num_groups_; ++g) {
    const auto& [buffer, overwrite] = targets[single_weight_ ? 0 : g];
    if (buffer.defined()) buffers[g] = {single_weight_ ? buffer.select(0, g) : buffer, overwrite};
  }
  {
    const at::NoGradGuard no_grad;  // buffers, not part of any graph
    if (ctx.fp8.gemm_fp8) {
      fp8_weight_grads_into(ctx, grad, buffers);
    } else if (const auto sizes = host_sizes_at_hand(ctx, grad)) {
      weight_grads_into(grad, x, *sizes, buffers);
    } else {
      // Split sizes on the device: the one grouped GEMM (in the compute dtype), then added. A
      // GEMM per group would wait for the sizes on the host and break CUDA-graph capture.
      const auto dw = kernels::grouped_linear_wgrad(grad.wgrad, x, ctx.saved_tensors.at(0));
      for (int64_t g = 0; g < num_groups_; ++g) {
        const auto& [buffer, overwrite] = buffers[g];
        if (buffer.defined()) overwrite ? buffer.copy_(dw[g]) : buffer.add_(dw[g]);
      }
    }
  }
  for (int64_t i = 0; i < nw; ++i) {
    if (targets[i].first.defined()) grads[i] = main_grad_->result(i).value_or(at::Tensor());
  }
}

at::Tensor GroupedLinear::split_sizes_for(const at::Tensor& sizes, const at::Tensor& x) const {
  TORCH_CHECK_VALUE(sizes.scalar_type() == at::kInt || sizes.scalar_type() == at::kLong,
                    "GroupedLinear: expected split sizes of dtype int32 or int64, got ",
                    sizes.scalar_type());
  TORCH_CHECK_VALUE(sizes.dim() == 1 && sizes.numel() == num_groups_,
                    "GroupedLinear: expected split sizes of shape [", num_groups_,
                    "] (one per group), got ", sizes.sizes());
  // te.ops moves host split sizes to the input's device too.
  return sizes.device() == x.device() ? sizes : sizes.to(x.device());
}

at::Tensor GroupedLinear::grouped_param(const OperationContext& ctx, int64_t first, bool single,
                                        const char* name, c10::IntArrayRef shape) const {
  constexpr const char* op = "GroupedLinear";
  const int64_t count = num_groups_;
  if (single) {
    const auto& p = ctx.param(first, op);
    std::vector<int64_t> full{num_groups_};
    full.insert(full.end(), shape.begin(), shape.end());
    check_param_shape(op, name, p, full);
    return p;
  }
  std::vector<at::Tensor> params;
  for (int64_t g = 0; g < count; ++g) {
    params.push_back(ctx.param(first + g, op));
    check_param_shape(op, name, params.back(), shape);
  }
  if (!consecutive_slices(params)) return at::stack(params);
  std::vector<int64_t> full{count}, strides{c10::multiply_integers(shape)};
  full.insert(full.end(), shape.begin(), shape.end());
  const auto inner = c10::contiguous_strides(shape);
  strides.insert(strides.end(), inner.begin(), inner.end());
  return params.front().as_strided(full, strides);
}

at::Tensor GroupedLinear::fuser_forward(const std::vector<OperationContext*>& ctxs,
                                        const at::Tensor& input, const TensorLists& extra_inputs,
                                        TensorLists&, const ForwardArgs& args) {
  return forward(*ctxs.at(0), input, extra_inputs.at(0), args);
}

at::Tensor GroupedLinear::forward(OperationContext& ctx, const at::Tensor& input,
                                  const std::vector<at::Tensor>& extra_inputs,
                                  const ForwardArgs& args, bool keep_input,
                                  std::vector<int64_t>* known_host_sizes) {
  constexpr const char* op = "GroupedLinear";
  const auto& w0 = ctx.param(0, op);
  check_input_against_param(op, input, w0);
  FUSIBLE_CHECK_MIN_DIM(op, "input", input, 1);
  TORCH_CHECK(input.size(-1) == in_features_,
              "GroupedLinear: expected input.size(-1) == ", "in_features (", in_features_,
              "), got ", input.size(-1), " (input shape ", shape_str(input), ")");
  const int64_t rows = input.numel() / in_features_;
  const auto sizes = split_sizes_for(extra_inputs.at(0), input);
  ctx.compute_dtype = compute_dtype(args, w0.scalar_type());
  const auto x_nd = cast_to(input, ctx.compute_dtype);
  const auto x = x_nd.reshape({rows, in_features_});
  const int64_t nw = num_weight_params();
  bool any_weight_grad = false;
  for (int64_t i = 0; i < nw; ++i) any_weight_grad |= ctx.param_requires_grad.at(i);
  const bool need_x = ctx.requires_grad && any_weight_grad;
  // Under an FP8 autocast the GEMMs see each group's x and W cast by its own quantizers (te.ops'
  // per-group quantizers): FP8 GEMMs per group where they fit, else emulated (cast to FP8 and
  // back, the grouped GEMM in the compute dtype).
  ctx.fp8 = fp8_cast(input, rows);  // all groups' tokens against the recipe's min_tokens
  std::vector<int64_t> host_sizes;
  if (ctx.fp8.on()) {
    if (known_host_sizes != nullptr && !known_host_sizes->empty()) {
      host_sizes = *known_host_sizes;
      check_split_sum(host_sizes, rows);
    } else {
      host_sizes = host_split_sizes(sizes, rows);
      if (known_host_sizes != nullptr) *known_host_sizes = host_sizes;
    }
  }
  ctx.fp8.gemm_fp8 =
      ctx.fp8.on() && fp8_gemms_fit(ctx.fp8, host_sizes, ctx.compute_dtype, input.device());
  at::Tensor bias;
  if (has_bias_) {
    bias =
        cast_to(grouped_param(ctx, nw, single_bias_, "bias", {out_features_}), ctx.compute_dtype);
  }
  at::Tensor y;
  if (ctx.fp8.gemm_fp8) {
    y = fp8_forward(ctx, x, sizes, host_sizes, bias, need_x);
  } else {
    auto x_gemm = x;
    at::Tensor x_wgrad = x_nd;  // as it came (see below)
    if (ctx.fp8.on()) {
      std::tie(x_gemm, x_wgrad) =
          cast_groups(x, host_sizes, true, need_x, [&](int64_t g, auto& part) {
            return ctx.fp8.forward_operand(part, g, /*weight=*/false, true, need_x);
          });
    }
    at::Tensor weight, weight_dgrad;  // the dgrad's: under FP8 its own cast (fp8_weights)
    if (ctx.fp8.on()) {
      std::tie(weight, weight_dgrad) =
          fp8_weights(ctx, ctx.requires_grad && ctx.input_requires_grad);
    } else {
      weight =
          cast_to(grouped_param(ctx, 0, single_weight_, "weight", {out_features_, in_features_}),
                  ctx.compute_dtype);
      weight_dgrad = weight;
    }
    at::Tensor scales;  // scale_bias: one per row, as given
    if (scale_bias_) {
      scales = extra_inputs.at(1);
      kernels::check_grouped_scales(op, x, scales);
    }
    y = kernels::grouped_linear_fwd(
        x_gemm, weight, sizes, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
        scales.defined() ? std::optional<at::Tensor>(cast_to(scales, ctx.compute_dtype))
                         : std::nullopt);
    if (ctx.requires_grad) {
      // (split sizes, x for wgrad, the weights for dgrad, then with scale_bias: scales and
      // biases). x as it came, not its 2-D view: a view made here (grad mode off) of a caller's
      // tensor that an earlier op wrote in place is refused by autograd once the fuser marks that
      // tensor dirty. Under FP8 the cast x is kept whatever keep_input says: a recast would not be
      // the forward's.
      std::vector<at::Tensor> saved{sizes,
                                    need_x && (keep_input || ctx.fp8.on()) ? x_wgrad : at::Tensor(),
                                    ctx.input_requires_grad ? weight_dgrad : at::Tensor(), scales,
                                    scale_bias_ ? bias : at::Tensor()};
      // A saved view over every group's parameters (their storage is one) carries group 0's
      // version counter only: the others' versions are checked before the backward, so that an
      // in-place change to any of them raises, as it does for a Linear.
      const auto check_versions_of = [&](const at::Tensor& view, int64_t first, bool single) {
        if (!view.defined() || single || !view.is_alias_of(ctx.params.at(first))) return;
        for (int64_t g = 1; g < num_groups_; ++g) {
          const auto& p = ctx.params.at(first + g);
          ctx.read_versions.emplace_back(p, p._version());
        }
      };
      check_versions_of(saved[2], 0, single_weight_);
      check_versions_of(saved[4], nw, single_bias_);
      ctx.save_for_backward(std::move(saved));
    }
  }
  auto shape = input.sizes().vec();
  shape.back() = out_features_;
  // te.ops' caller buffers (op_kwargs "output" / "grad_input"): written and handed back.
  const auto buffers = call_buffers(this);
  if (buffers.grad_input.defined() && ctx.input_requires_grad) {
    check_call_buffer(op, "grad_input", buffers.grad_input, input.sizes(), ctx.compute_dtype,
                      input.device());
    ctx.state = buffers.grad_input;
  }
  if (buffers.output.defined()) {
    check_call_buffer(op, "output", buffers.output, shape, ctx.compute_dtype, input.device());
    return buffers.output.copy_(y.reshape(shape));
  }
  return y.reshape(shape);
}

std::pair<at::Tensor, at::Tensor> GroupedLinear::fp8_weights(OperationContext& ctx,
                                                             bool dgrad) const {
  const bool own_columnwise = dgrad && ctx.fp8.needs_columnwise();
  std::vector<at::Tensor> ws, ws_dgrad;
  for (int64_t g = 0; g < num_groups_; ++g) {
    auto o = ctx.fp8.forward_operand_from(weight_of(ctx, g), ctx.compute_dtype, num_groups_ + g,
                                          /*weight=*/true, /*rowwise=*/true,
                                          /*columnwise=*/own_columnwise);
    ws.push_back(o.rowwise);
    if (own_columnwise) ws_dgrad.push_back(o.columnwise);
  }
  auto forward = at::stack(ws);
  if (!dgrad) return {forward, at::Tensor()};
  return {forward, own_columnwise ? at::stack(ws_dgrad) : forward};
}

at::Tensor GroupedLinear::weight_of(const OperationContext& ctx, int64_t g) const {
  constexpr const char* op = "GroupedLinear";
  const auto& p = ctx.param(single_weight_ ? 0 : g, op);
  if (single_weight_) {
    check_param_shape(op, "weight", p, {num_groups_, out_features_, in_features_});
    return p.select(0, g);
  }
  check_param_shape(op, "weight", p, {out_features_, in_features_});
  return p;
}

GroupedLinear::Grad GroupedLinear::grad_operands(const OperationContext& ctx,
                                                 const at::Tensor& dy) const {
  ctx.check_read_versions("GroupedLinear");
  if (!ctx.fp8.on()) return {dy, dy, dy};
  const bool need_dx = ctx.input_requires_grad;
  bool need_dw = false;
  for (int64_t i = 0; i < num_weight_params(); ++i) need_dw |= ctx.param_requires_grad.at(i);
  // With FP8 GEMMs the forward kept the sizes on the host too: no second wait for the device.
  const auto sizes = host_split_sizes(
      ctx.saved_tensors.at(ctx.fp8.gemm_fp8 ? fp8_host_sizes_slot() : 0), dy.size(0));
  if (ctx.fp8.gemm_fp8) {  // each group's dy cast for its own GEMMs
    Grad grad{dy, {}, {}, {}, sizes};
    if (ctx.fp8.takes_produced_amax()) {  // all groups in one grouped cast
      grad.groups = ctx.fp8.grouped_operands(dy, sizes, /*backward=*/true, need_dw);
      return grad;
    }
    int64_t start = 0;
    for (size_t g = 0; g < sizes.size(); ++g) {
      grad.groups.push_back(sizes[g] == 0 ? GemmOperand()
                                          : ctx.fp8.backward_operand(dy.narrow(0, start, sizes[g]),
                                                                     g, need_dx, need_dw));
      start += sizes[g];
    }
    return grad;
  }
  auto [dgrad, wgrad] = cast_groups(dy, sizes, need_dx, need_dw, [&](int64_t g, auto& part) {
    return ctx.fp8.backward_operand(part, g, need_dx, need_dw);
  });
  return {dy, dgrad, wgrad, {}, sizes};
}

at::Tensor GroupedLinear::input_grad(const OperationContext& ctx, const Grad& grad) const {
  if (!ctx.input_requires_grad) return {};
  auto dx = ctx.fp8.gemm_fp8 ? fp8_input_grad(ctx, grad)
                             : kernels::grouped_linear_dgrad(grad.dgrad, ctx.saved_tensors.at(2),
                                                             ctx.saved_tensors.at(0));
  if (!ctx.state.isTensor()) return dx;
  const auto& buffer = ctx.state.toTensor();  // the caller's grad_input buffer, in x's shape
  buffer.view({-1, in_features_}).copy_(dx);
  return buffer;
}

std::pair<std::vector<at::Tensor>, at::Tensor> GroupedLinear::param_grads(
    const OperationContext& ctx, const Grad& grad, const at::Tensor& input) const {
  const auto& dy = grad.dy;
  const auto& saved = ctx.saved_tensors;
  const auto& sizes = saved.at(0);
  const auto& scales = saved.at(3);
  const auto& bias = saved.at(4);
  const int64_t nw = num_weight_params(), nb = num_bias_params();
  std::vector<at::Tensor> grads(ctx.param_requires_grad.size());
  bool need_dw = false;
  for (int64_t i = 0; i < nw; ++i) need_dw |= ctx.param_requires_grad.at(i);
  if (need_dw && main_grad_ && !param_grad_reduction()) {  // into main_grad
    at::Tensor x;  // FP8 GEMMs read the x^T the forward cast
    if (!ctx.fp8.gemm_fp8) {
      x = input.defined() && !ctx.fp8.on() ? input : saved.at(1).reshape({-1, in_features_});
    }
    weight_grads_into_main_grad(ctx, grad, x, grads);
  } else if (need_dw && ctx.fp8.gemm_fp8) {  // the forward's FP8 x^T per group
    auto dws = fp8_weight_grads(ctx, grad);
    if (single_weight_) {
      if (ctx.param_requires_grad.at(0)) grads[0] = at::stack(dws);
    } else {
      for (int64_t i = 0; i < nw; ++i) {
        if (ctx.param_requires_grad.at(i)) grads[i] = std::move(dws[i]);
      }
    }
  } else if (need_dw) {
    const auto x =
        input.defined() && !ctx.fp8.on() ? input : saved.at(1).reshape({-1, in_features_});
    const auto dw = kernels::grouped_linear_wgrad(grad.wgrad, x, sizes);
    for (int64_t i = 0; i < nw; ++i) {
      if (ctx.param_requires_grad.at(i)) grads[i] = single_weight_ ? dw : dw[i];
    }
  }
  bool need_dbias = false;
  for (int64_t i = 0; i < nb; ++i) need_dbias |= ctx.param_requires_grad.at(nw + i);
  const bool need_dscales =
      scale_bias_ && ctx.extra_input_requires_grad.size() > 1 && ctx.extra_input_requires_grad[1];
  at::Tensor dscales;
  if (need_dbias || need_dscales) {
    auto [dbias, ds] = kernels::grouped_bias_bwd(
        dy, sizes, scales.defined() ? std::optional<at::Tensor>(scales) : std::nullopt,
        need_dscales ? std::optional<at::Tensor>(bias) : std::nullopt);
    for (int64_t i = 0; i < nb; ++i) {
      if (ctx.param_requires_grad.at(nw + i)) grads[nw + i] = single_bias_ ? dbias : dbias[i];
    }
    if (need_dscales) dscales = ds;
  }
  return {std::move(grads), dscales};
}

BackwardResult GroupedLinear::fuser_backward(const std::vector<OperationContext*>& ctxs,
                                             const at::Tensor& grad_output, const TensorLists&) {
  auto& ctx = *ctxs.at(0);
  const auto dy =
      grad_operands(ctx, cast_to(grad_output, ctx.compute_dtype).reshape({-1, out_features_}));
  at::Tensor dx = input_grad(ctx, dy);
  if (dx.defined()) {
    auto shape = grad_output.sizes().vec();
    shape.back() = in_features_;
    if (!dx.sizes().equals(shape)) dx = dx.reshape(shape);  // a caller's buffer is already
  }
  auto [grads, dscales] = param_grads(ctx, dy, at::Tensor());
  std::vector<at::Tensor> extra_grads{at::Tensor()};
  if (scale_bias_) extra_grads.push_back(dscales);
  return {dx, {grads}, {extra_grads}};
}

}  // namespace fusible::ops

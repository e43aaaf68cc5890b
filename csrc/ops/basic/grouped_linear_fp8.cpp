// GroupedLinear on FP8 data: one cuBLASLt FP8 GEMM per group (ops/linear_gemms.h) writing its rows
// of the output, each group's x, W and dy cast with its own scale, as one Linear per group computes
// under FP8 (current scaling: one grouped cast per tensor for all groups; delayed: a cast per group
// by its own quantizer).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "ops/basic/grouped_linear.h"
#include "ops/linear_gemms.h"

namespace fusible::ops {
namespace {

// Saved slot i (FP8 data saved transposed, with its scale_inv) as the GEMM operand it was.
GemmOperand saved_fp8(const OperationContext& ctx, int64_t i) {
  GemmOperand o;
  o.dtype = ctx.compute_dtype;
  o.columnwise = ctx.saved_tensors.at(i);
  o.columnwise_scale_inv = ctx.fp8.saved_scale_inv.at(i);
  return o;
}

}  // namespace

bool GroupedLinear::fp8_gemms_fit(const Fp8Cast& cast, const std::vector<int64_t>& sizes,
                                  at::ScalarType dtype, c10::Device device) const {
  // Block scaling's grouped casts stay emulated; so do per-row bias scales (no GEMM epilogue).
  if (scale_bias_ || cast.recipe->kind == "block") return false;
  for (auto m : sizes) {
    if (m % 16 != 0) return false;  // the wgrad's K: FP8 rows of 16 bytes
  }
  return cast.fp8_gemms_fit(16, in_features_, out_features_, dtype, device);
}

at::Tensor GroupedLinear::grouped_cast_weights(const OperationContext& ctx) const {
  for (int64_t i = 0; i < num_weight_params(); ++i) {
    if (ctx.param(i, "GroupedLinear").key_set().has(c10::DispatchKey::Python)) return {};
  }
  // A wider weight (float32 under torch.autocast) is cast from itself, as forward_operand_from.
  return ctx.fp8
      .cast_source(grouped_param(ctx, 0, single_weight_, "weight", {out_features_, in_features_}),
                   ctx.compute_dtype)
      .reshape({-1, in_features_});
}

at::Tensor GroupedLinear::fp8_forward(OperationContext& ctx, const at::Tensor& x,
                                      const at::Tensor& sizes,
                                      const std::vector<int64_t>& host_sizes,
                                      const at::Tensor& bias, bool need_x) {
  const int64_t n = num_groups_;
  const bool need_w = ctx.requires_grad && ctx.input_requires_grad;
  std::vector<at::Tensor> saved(kFp8Slots + 2 * n + 1), scale_inv(kFp8Slots + 2 * n + 1);
  // Each group's GEMM writes its rows of y: no concatenation after them.
  auto y = at::empty({x.size(0), out_features_}, x.options());
  // Current scaling casts all groups' x (and, as they are plain tensors, all weights) in one
  // grouped cast each; otherwise each group's tensors are cast by their own quantizers.
  std::vector<GemmOperand> xs, ws;
  if (ctx.fp8.takes_produced_amax()) {
    xs = ctx.fp8.grouped_operands(x, host_sizes, /*backward=*/false, need_x);
    if (const auto w = grouped_cast_weights(ctx); w.defined()) {
      ws = ctx.fp8.grouped_operands(w, std::vector<int64_t>(n, out_features_),
                                    /*backward=*/false, need_w, ctx.compute_dtype);
    }
  }
  int64_t start = 0;
  for (int64_t g = 0; g < n; ++g) {
    // Every group's weight is cast, an empty group's too (a delayed-scaling history advances
    // once per forward, as with one Linear per group).
    const int64_t m = host_sizes[g];
    const auto wo = !ws.empty() ? ws[g]
                                : ctx.fp8.forward_operand_from(
                                      weight_of(ctx, g), ctx.compute_dtype, n + g,
                                      /*weight=*/true, /*rowwise=*/true, need_w && m > 0);
    if (m == 0) continue;
    const auto xo = !xs.empty()
                        ? xs[g]
                        : ctx.fp8.forward_operand(x.narrow(0, start, m), g,
                                                  /*weight=*/false, /*rowwise=*/true, need_x);
    gemms::forward_into(
        xo, wo, bias.defined() ? std::optional<at::Tensor>(bias.select(0, g)) : std::nullopt,
        y.narrow(0, start, m));
    start += m;
    if (need_x) {
      saved[kFp8Slots + g] = xo.columnwise;
      scale_inv[kFp8Slots + g] = xo.columnwise_scale_inv;
    }
    if (need_w) {
      saved[kFp8Slots + n + g] = wo.columnwise;
      scale_inv[kFp8Slots + n + g] = wo.columnwise_scale_inv;
    }
  }
  if (ctx.requires_grad) {
    saved[0] = sizes;
    auto& host = saved[fp8_host_sizes_slot()];
    host = at::empty({n}, at::TensorOptions().dtype(at::kLong));
    std::copy(host_sizes.begin(), host_sizes.end(), host.data_ptr<int64_t>());
    ctx.save_for_backward(std::move(saved));
    ctx.fp8.saved_scale_inv = std::move(scale_inv);
  }
  return y;
}

at::Tensor GroupedLinear::fp8_input_grad(const OperationContext& ctx, const Grad& grad) const {
  auto dx = at::empty({grad.dy.size(0), in_features_}, grad.dy.options());
  int64_t start = 0;
  for (int64_t g = 0; g < num_groups_; ++g) {
    const int64_t m = grad.sizes[g];
    if (m == 0) continue;
    gemms::dgrad_into(grad.groups[g], saved_fp8(ctx, kFp8Slots + num_groups_ + g),
                      dx.narrow(0, start, m));
    start += m;
  }
  return dx;
}

std::vector<at::Tensor> GroupedLinear::fp8_weight_grads(const OperationContext& ctx,
                                                        const Grad& grad) const {
  std::vector<at::Tensor> dws;
  for (int64_t g = 0; g < num_groups_; ++g) {
    if (!single_weight_ && !ctx.param_requires_grad.at(g)) {  // a frozen expert: no GEMM
      dws.emplace_back();
    } else if (grad.sizes[g] == 0) {
      dws.push_back(at::zeros({out_features_, in_features_}, grad.dy.options()));
    } else {
      dws.push_back(gemms::wgrad(grad.groups[g], saved_fp8(ctx, kFp8Slots + g)));
    }
  }
  return dws;
}

void GroupedLinear::fp8_weight_grads_into(const OperationContext& ctx, const Grad& grad,
                                          const MainGradBuffers& buffers) const {
  for (int64_t g = 0; g < num_groups_; ++g) {
    const auto& [buffer, overwrite] = buffers[g];
    if (!buffer.defined()) continue;
    if (grad.sizes[g] == 0) {  // no rows: a zero gradient
      if (overwrite) buffer.zero_();
      continue;
    }
    gemms::wgrad_into(grad.groups[g], saved_fp8(ctx, kFp8Slots + g), buffer, 1.0,
                      /*accumulate=*/!overwrite);
  }
}

}  // namespace fusible::ops

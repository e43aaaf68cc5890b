// Extending fusible from C++: a custom basic op (a learnable scale), a custom fused op, and a
// forward fusion registered in the fusion registry, mixed with built-in ops in one fuser.
// Usage: custom_op
#include <ATen/ATen.h>
#include <fusible/fusible.h>

#include <cstdio>

using namespace fusible;

// y = w * x with a learnable scalar w.
class LearnableScale : public ops::BasicOperation {
 public:
  LearnableScale() : BasicOperation("LearnableScale") {
    w_ = register_parameter("weight", at::full({}, 1.5, at::kDouble));
  }
  at::Tensor op_forward(ops::OperationContext& ctx, const at::Tensor& x,
                        const ops::ForwardArgs&) override {
    if (ctx.requires_grad) ctx.save_for_backward({x, ctx.param(0, "LearnableScale")});
    return ctx.param(0, "LearnableScale") * x;  // the call's weight, not a captured one
  }
  std::pair<at::Tensor, std::vector<at::Tensor>> op_backward(ops::OperationContext& ctx,
                                                             const at::Tensor& dy) override {
    const auto& x = ctx.saved_tensors.at(0);
    const auto& w = ctx.saved_tensors.at(1);
    return {w * dy, {(dy * x).sum()}};
  }
  at::Tensor w_;
};

// Forward-only fusion of LearnableScale + Bias: one expression, and the same contexts the unfused
// forwards fill (LearnableScale saves x and w; Bias saves nothing), so the backward can run
// unfused.
class ForwardScaleBias : public ops::FusedOperation {
 public:
  ForwardScaleBias(std::shared_ptr<LearnableScale> scale, std::shared_ptr<ops::Bias> bias)
      : FusedOperation("ForwardScaleBias", {scale, bias}), scale_(scale), bias_(bias) {
    set_fused_directions(true, false);
  }
  at::Tensor fuser_forward(const std::vector<ops::OperationContext*>& ctxs, const at::Tensor& x,
                           const ops::TensorLists&, ops::TensorLists&,
                           const ops::ForwardArgs&) override {
    const auto& w = ctxs[0]->param(0, "ForwardScaleBias");
    const auto& b = ctxs[1]->param(0, "ForwardScaleBias");
    if (ctxs[0]->requires_grad) ctxs[0]->save_for_backward({x, w});
    ctxs[1]->compute_dtype = b.scalar_type();
    return at::addcmul(b, w, x);
  }

 private:
  std::shared_ptr<LearnableScale> scale_;
  std::shared_ptr<ops::Bias> bias_;
};

ops::OpList fuse_scale_bias(ops::OpList list, const ops::FusionContext&) {
  ops::OpList out;
  for (size_t i = 0; i < list.size(); ++i) {
    auto scale = std::dynamic_pointer_cast<LearnableScale>(list[i]);
    auto bias = i + 1 < list.size() ? std::dynamic_pointer_cast<ops::Bias>(list[i + 1]) : nullptr;
    if (scale && bias) {
      out.push_back(std::make_shared<ForwardScaleBias>(scale, bias));
      ++i;
    } else {
      out.push_back(list[i]);
    }
  }
  return out;
}

int main() {
  ops::FusionRegistry::instance().add("ForwardScaleBias", ops::FusionPass::kForward,
                                      fuse_scale_bias);
  auto scale = std::make_shared<LearnableScale>();
  auto bias = std::make_shared<ops::Bias>(4, c10::Device(c10::kCPU), at::kDouble);
  fuser::OperationFuser model({scale, bias, std::make_shared<ops::GELU>()});

  const auto x = at::randn({3, 4}, at::kDouble);
  const auto y = model.forward(x, {})[0];
  y.sum().backward();
  const auto [fwd, bwd] = model.fusion_plan();
  std::printf("forward plan:");
  for (const auto& n : fwd) std::printf(" %s", n.c_str());
  std::printf("\nbackward plan:");
  for (const auto& n : bwd) std::printf(" %s", n.c_str());
  std::printf("\nd(loss)/d(scale) = %.6f\n", scale->w_.grad().item<double>());

  // Check against plain ATen: y = gelu_tanh(w x + b).
  const auto w = scale->w_.detach().clone().requires_grad_();
  const auto ref = at::gelu(w * x + bias->bias().detach(), "tanh");
  ref.sum().backward();
  const bool ok =
      at::allclose(y, ref, 1e-12, 1e-12) && at::allclose(scale->w_.grad(), w.grad(), 1e-12, 1e-12);
  std::printf("matches ATen: %s\n", ok ? "yes" : "NO");
  return ok ? 0 : 1;
}

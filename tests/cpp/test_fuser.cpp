// OperationFuser from C++: values and gradients, a custom fusion registered from the test, plan
// checks, first-backward index, and the C++ Sequential.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "test_utils.h"

namespace fusible::test {
namespace {

using fuser::OperationFuser;
using ops::FusibleOperation;

// Fused forward of two consecutive ConstantScale ops: one multiply by the product.
class ForwardScaleScale : public ops::FusedOperation {
 public:
  ForwardScaleScale(std::shared_ptr<ops::ConstantScale> a, std::shared_ptr<ops::ConstantScale> b)
      : FusedOperation("ForwardScaleScale", {a, b}), product_(a->scale() * b->scale()) {
    set_fused_directions(true, false);
  }
  at::Tensor fuser_forward(const std::vector<ops::OperationContext*>&, const at::Tensor& x,
                           const ops::TensorLists&, ops::TensorLists&,
                           const ops::ForwardArgs&) override {
    return kernels::scale_fwd(x, product_);
  }

 private:
  double product_;
};

ops::OpList fuse_scale_pairs(ops::OpList list, const ops::FusionContext&) {
  ops::OpList out;
  for (size_t i = 0; i < list.size(); ++i) {
    auto a = std::dynamic_pointer_cast<ops::ConstantScale>(list[i]);
    auto b =
        i + 1 < list.size() ? std::dynamic_pointer_cast<ops::ConstantScale>(list[i + 1]) : nullptr;
    if (a && b) {
      out.push_back(std::make_shared<ForwardScaleScale>(a, b));
      ++i;
    } else {
      out.push_back(list[i]);
    }
  }
  return out;
}

TEST(Fuser, CustomForwardFusionAppearsInPlanAndMatchesUnfused) {
  RegistryGuard guard;
  std::vector<std::shared_ptr<FusibleOperation>> op_list{
      std::make_shared<ops::ConstantScale>(0.5), std::make_shared<ops::ConstantScale>(3.0),
      std::make_shared<ops::Bias>(4, c10::Device(c10::kCPU), at::kDouble)};
  OperationFuser unfused(op_list);
  const auto x = at::randn({3, 4}, at::kDouble).requires_grad_();
  const auto y_ref = unfused.forward(x, {})[0];
  const auto g_ref = torch::autograd::grad({y_ref.pow(2).sum()}, {x})[0];

  ops::FusionRegistry::instance().add("scale_pairs", ops::FusionPass::kForward, fuse_scale_pairs);
  OperationFuser fused(op_list);
  const auto y = fused.forward(x, {})[0];
  const auto [fwd, bwd] = fused.fusion_plan();
  EXPECT_EQ(fwd, (std::vector<std::string>{"ForwardScaleScale", "Bias"}));
  EXPECT_EQ(bwd, (std::vector<std::string>{"ConstantScale", "ConstantScale", "Bias"}));
  EXPECT_TRUE(at::allclose(y, y_ref, 1e-12, 1e-12));
  const auto g = torch::autograd::grad({y.pow(2).sum()}, {x})[0];
  EXPECT_TRUE(at::allclose(g, g_ref, 1e-12, 1e-12));
  // The unfused fuser re-plans on its next call and picks the fusion up too.
  unfused.forward(x, {});
  EXPECT_EQ(unfused.fusion_plan().first.front(), "ForwardScaleScale");
}

// A setting that fusions read (cache_quantized_input, which the GEMM-epilogue fusion declines)
// changed after a call re-plans the next one.
TEST(Fuser, ChangingAFusionRelevantSettingReplans) {
  const c10::Device cpu(c10::kCPU);
  auto lin = std::make_shared<ops::BasicLinear>(8, 8, cpu, at::kFloat);
  auto bias = std::make_shared<ops::Bias>(8, cpu, at::kFloat);
  auto gelu = std::make_shared<ops::GELU>();
  OperationFuser fuser({lin, bias, gelu});
  const auto x = at::randn({4, 8}).requires_grad_();
  fuser.forward(x, {});
  const auto fused = fuser.fusion_plan().first;
  ASSERT_EQ(fused.size(), 1u) << fused.front();
  gelu->set_cache_quantized_input(true);
  fuser.forward(x, {});
  const auto replanned = fuser.fusion_plan().first;
  EXPECT_GT(replanned.size(), 1u);
  EXPECT_EQ(replanned.back(), "GELU");
}

TEST(Fuser, FusionThatDropsOpsIsRejected) {
  RegistryGuard guard;
  ops::FusionRegistry::instance().add("broken", ops::FusionPass::kForwardBackward,
                                      [](ops::OpList list, const ops::FusionContext&) {
                                        list.pop_back();
                                        return list;
                                      });
  OperationFuser f({std::make_shared<ops::Identity>(), std::make_shared<ops::Identity>()});
  expect_error_contains([&] { f.forward(at::randn({2}), {}); }, "fusion 'broken'");
}

TEST(Fuser, FirstBackwardIndexSkipsFrozenOps) {
  auto ln = std::make_shared<ops::LayerNorm>(std::vector<int64_t>{4}, 1e-5, c10::Device(c10::kCPU));
  auto lin = std::make_shared<ops::Linear>(4, 3, true, c10::Device(c10::kCPU));
  for (auto& p : ln->parameters()) p.requires_grad_(false);
  OperationFuser f({ln, lin});
  const auto y = f.forward(at::randn({2, 4}), {})[0];
  y.sum().backward();
  EXPECT_FALSE(ln->weight().grad().defined());
  EXPECT_TRUE(lin->weight().grad().defined());
  EXPECT_TRUE(lin->bias_op()->bias().grad().defined());
}

TEST(Fuser, NoGradModeBuildsNoNode) {
  OperationFuser f({std::make_shared<ops::Linear>(4, 3, true, c10::Device(c10::kCPU))});
  const at::NoGradGuard no_grad;
  const auto y = f.forward(at::randn({2, 4}).requires_grad_(), {})[0];
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
}

TEST(Sequential, RunsGroupsAndPlainSteps) {
  fuser::Sequential seq;
  seq.push_back(std::make_shared<ops::Linear>(4, 4, true, c10::Device(c10::kCPU), at::kDouble));
  seq.push_back([](const at::Tensor& t) { return at::tanh(t); }, "Tanh");
  seq.push_back(std::make_shared<ops::ConstantScale>(2.0));
  EXPECT_EQ(seq.parameters().size(), 2u);
  const auto x = at::randn({3, 4}, at::kDouble);
  const auto y = seq.forward(x)[0];
  auto lin = std::dynamic_pointer_cast<ops::Linear>(seq.children()[0]);
  ASSERT_TRUE(lin);
  const auto ref = 2 * at::tanh(at::linear(x, lin->weight(), lin->bias_op()->bias()));
  EXPECT_TRUE(at::allclose(y, ref, 1e-12, 1e-12));
  const auto plan = seq.fusion_plan();
  ASSERT_EQ(plan.size(), 3u);
  EXPECT_EQ(plan[1].module, "Tanh");
  EXPECT_EQ(plan[0].forward, (std::vector<std::string>{"ForwardLinearBiasActivation"}));
  EXPECT_EQ(plan[0].backward, (std::vector<std::string>{"BasicLinear", "Bias"}));
}

// LibTorch's replace_module and unregister_module (not virtual) reach the next call: the forward
// computes with the new child, without the removed one, and parameters() agrees with it.
TEST(Sequential, FollowsReplaceModuleAndUnregisterModule) {
  const c10::Device cpu(c10::kCPU);
  auto a = std::make_shared<ops::Linear>(4, 4, true, cpu, at::kDouble);
  auto b = std::make_shared<ops::Linear>(4, 4, true, cpu, at::kDouble);
  auto c = std::make_shared<ops::Linear>(4, 4, true, cpu, at::kDouble);
  for (const auto& p :
       std::vector<at::Tensor>{a->bias_op()->bias(), b->bias_op()->bias(), c->bias_op()->bias()}) {
    at::NoGradGuard no_grad;
    p.normal_();
  }
  auto seq = std::make_shared<fuser::Sequential>(
      std::vector<std::shared_ptr<ops::FusibleOperation>>{a, b, std::make_shared<ops::GELU>()});
  const auto x = at::randn({3, 4}, at::kDouble);
  const auto lin = [](const at::Tensor& t, const std::shared_ptr<ops::Linear>& l) {
    return at::linear(t, l->weight(), l->bias_op()->bias());
  };
  const auto gelu = [](const at::Tensor& t) { return at::gelu(t, "tanh"); };
  EXPECT_TRUE(at::allclose(seq->forward(x)[0], gelu(lin(lin(x, a), b)), 1e-12, 1e-12));
  seq->replace_module("1", c);
  // A copy, a reset and the size follow it before any call.
  EXPECT_EQ(seq->size(), 3u);
  auto copy = std::dynamic_pointer_cast<fuser::Sequential>(seq->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(at::allclose(copy->forward(x)[0], gelu(lin(lin(x, a), c)), 1e-12, 1e-12));
  const auto y = seq->forward(x)[0];
  EXPECT_TRUE(at::allclose(y, gelu(lin(lin(x, a), c)), 1e-12, 1e-12));
  y.sum().backward();
  EXPECT_TRUE(c->weight().grad().defined());
  EXPECT_FALSE(b->weight().grad().defined());
  seq->unregister_module("1");
  EXPECT_EQ(seq->size(), 2u);
  EXPECT_TRUE(at::allclose(seq->forward(x)[0], gelu(lin(x, a)), 1e-12, 1e-12));
  seq->register_module("extra", std::make_shared<torch::nn::Module>());  // not a step: ignored
  EXPECT_TRUE(at::allclose(seq->forward(x)[0], gelu(lin(x, a)), 1e-12, 1e-12));
  EXPECT_EQ(seq->parameters().size(), 2u);
  seq->push_back(b);  // a fresh name: "2" is the GELU's
  EXPECT_TRUE(at::allclose(seq->forward(x)[0], lin(gelu(lin(x, a)), b), 1e-12, 1e-12));
  auto before = seq->forward(x)[0];
  seq->replace_module("0", std::make_shared<torch::nn::Module>());
  EXPECT_THROW(seq->forward(x), c10::TypeError);
  seq->replace_module("0", a);  // the refusal changed nothing
  EXPECT_TRUE(at::allclose(seq->forward(x)[0], before, 0, 0));
}

}  // namespace
}  // namespace fusible::test

// Channels from C++: a producer that computes a fresh tensor feeding ScaledSwiGLU's scales (the
// gradient must reach it), fused ops that contain producer and consumer in each pass, and fused
// producers that omit an output someone outside needs.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "test_utils.h"

namespace fusible::test {
namespace {

using fuser::OperationFuser;
using ops::FusibleOperation;

// y = x; extra output 0 = 2 * w (a fresh tensor computed from the op's own parameter).
class ScaleProducer : public ops::BasicOperation {
 public:
  explicit ScaleProducer(int64_t rows) : BasicOperation("ScaleProducer", 0, 1) {
    w_ = register_parameter("w", at::rand({rows}, at::kDouble) + 0.5);
  }
  at::Tensor fuser_forward(const std::vector<ops::OperationContext*>&, const at::Tensor& x,
                           const ops::TensorLists&, ops::TensorLists& extra_out,
                           const ops::ForwardArgs&) override {
    extra_out.at(0) = {w_.detach() * 2};
    return x;
  }
  ops::BackwardResult fuser_backward(const std::vector<ops::OperationContext*>&,
                                     const at::Tensor& dy,
                                     const ops::TensorLists& grad_extra) override {
    const auto& g = grad_extra.at(0).at(0);
    return {dy, {{g.defined() ? g * 2 : at::Tensor()}}, {{}}};
  }
  at::Tensor w_;
};

TEST(Channels, FreshTensorProducerGetsScaleGradient) {
  auto producer = std::make_shared<ScaleProducer>(3);
  producer->set_extra_output_channel(0, "scales", /*output_to_caller=*/false);
  auto swiglu = std::make_shared<ops::ScaledSwiGLU>();
  swiglu->set_extra_input_channel(0, "scales");
  OperationFuser f({producer, swiglu});
  const auto x = at::randn({3, 8}, at::kDouble);  // no grad: only the producer's parameter
  const auto y = f.forward(x, {})[0];
  const auto dy = at::randn({3, 4}, at::kDouble);
  const auto dw = torch::autograd::grad({y}, {producer->w_}, {dy})[0];

  const auto w = producer->w_.detach().clone().requires_grad_();
  const auto a = x.narrow(-1, 0, 4), b = x.narrow(-1, 4, 4);
  const auto ref = (2 * w).unsqueeze(-1) * (a * at::sigmoid(a)) * b;
  EXPECT_TRUE(at::allclose(y, ref, 1e-12, 1e-12));
  const auto dw_ref = torch::autograd::grad({ref}, {w}, {dy})[0];
  EXPECT_TRUE(at::allclose(dw, dw_ref, 1e-12, 1e-12)) << dw << dw_ref;
}

// Runs [MakeExtraOutput -> ConstantScale -> AddExtraInput] as y = (s + 1) x, wiring the residual
// itself (it returns no tensor for the hidden extra output).
class FusedResidualScale : public ops::FusedOperation {
 public:
  FusedResidualScale(std::vector<std::shared_ptr<ops::BasicOperation>> ops, double s)
      : FusedOperation("FusedResidualScale", std::move(ops)), s_(s) {}
  at::Tensor fuser_forward(const std::vector<ops::OperationContext*>&, const at::Tensor& x,
                           const ops::TensorLists&, ops::TensorLists&,
                           const ops::ForwardArgs&) override {
    return kernels::scale_fwd(x, s_ + 1);
  }
  ops::BackwardResult fuser_backward(const std::vector<ops::OperationContext*>&,
                                     const at::Tensor& dy, const ops::TensorLists&) override {
    return {kernels::scale_fwd(dy, s_ + 1), {{}, {}, {}}, {{}, {}, {}}};
  }

 private:
  double s_;
};

ops::OpList fuse_residual_scale(ops::OpList list, const ops::FusionContext&) {
  if (list.size() == 3 && std::dynamic_pointer_cast<ops::MakeExtraOutput>(list[0]) &&
      std::dynamic_pointer_cast<ops::AddExtraInput>(list[2])) {
    const auto s = std::dynamic_pointer_cast<ops::ConstantScale>(list[1])->scale();
    std::vector<std::shared_ptr<ops::BasicOperation>> basic;
    for (auto& op : list) basic.push_back(op->basic_ops()[0]);
    return {std::make_shared<FusedResidualScale>(basic, s)};
  }
  return list;
}

class ChannelsFusedPass : public ::testing::TestWithParam<ops::FusionPass> {};

TEST_P(ChannelsFusedPass, FusedOpContainingProducerAndConsumer) {
  RegistryGuard guard;
  auto make = std::make_shared<ops::MakeExtraOutput>();
  make->set_extra_output_channel(0, "r", false);
  auto add = std::make_shared<ops::AddExtraInput>();
  add->set_extra_input_channel(0, "r");
  std::vector<std::shared_ptr<FusibleOperation>> list{
      make, std::make_shared<ops::ConstantScale>(2.5), add};
  const auto x = at::randn({4, 3}, at::kDouble).requires_grad_();
  const auto dy = at::randn({4, 3}, at::kDouble);
  OperationFuser unfused(list);
  const auto y_ref = unfused.forward(x, {})[0];
  const auto g_ref = torch::autograd::grad({y_ref}, {x}, {dy})[0];
  EXPECT_TRUE(at::allclose(y_ref, 3.5 * x, 1e-12, 1e-12));

  ops::FusionRegistry::instance().add("residual_scale", GetParam(), fuse_residual_scale);
  OperationFuser fused(list);
  const auto y = fused.forward(x, {})[0];
  const auto g = torch::autograd::grad({y}, {x}, {dy})[0];
  EXPECT_TRUE(at::allclose(y, y_ref, 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(g, g_ref, 1e-12, 1e-12));
  const auto [fwd, bwd] = fused.fusion_plan();
  const bool in_fwd = GetParam() != ops::FusionPass::kBackward;
  const bool in_bwd = GetParam() != ops::FusionPass::kForward;
  EXPECT_EQ(fwd.front(), in_fwd ? "FusedResidualScale" : "MakeExtraOutput");
  EXPECT_EQ(bwd.front(), in_bwd ? "FusedResidualScale" : "MakeExtraOutput");
  if (GetParam() == ops::FusionPass::kForwardBackward) {
    EXPECT_EQ(fused.plan()->forward[0].op.get(), fused.plan()->backward[0].op.get());
  }
}

INSTANTIATE_TEST_SUITE_P(Passes, ChannelsFusedPass,
                         ::testing::Values(ops::FusionPass::kForward, ops::FusionPass::kBackward,
                                           ops::FusionPass::kForwardBackward));

// Fuses [MakeExtraOutput, ConstantScale] and never returns the extra output.
class ForgetfulProducer : public ops::FusedOperation {
 public:
  explicit ForgetfulProducer(std::vector<std::shared_ptr<ops::BasicOperation>> ops)
      : FusedOperation("ForgetfulProducer", std::move(ops)) {
    set_fused_directions(true, false);
  }
  at::Tensor fuser_forward(const std::vector<ops::OperationContext*>&, const at::Tensor& x,
                           const ops::TensorLists&, ops::TensorLists&,
                           const ops::ForwardArgs&) override {
    return x * 2;
  }
};

ops::OpList fuse_forgetful(ops::OpList list, const ops::FusionContext&) {
  if (list.size() >= 2 && std::dynamic_pointer_cast<ops::MakeExtraOutput>(list[0])) {
    ops::OpList out{
        std::make_shared<ForgetfulProducer>(std::vector<std::shared_ptr<ops::BasicOperation>>{
            list[0]->basic_ops()[0], list[1]->basic_ops()[0]})};
    out.insert(out.end(), list.begin() + 2, list.end());
    return out;
  }
  return list;
}

TEST(Channels, FusedProducerOmittingANeededOutputFails) {
  RegistryGuard guard;
  ops::FusionRegistry::instance().add("forgetful", ops::FusionPass::kForward, fuse_forgetful);
  const auto x = at::randn({3}, at::kDouble);
  {
    OperationFuser f(
        {std::make_shared<ops::MakeExtraOutput>(), std::make_shared<ops::ConstantScale>(2.0)});
    expect_error_contains([&] { f.forward(x, {}); }, "is public");
  }
  auto make = std::make_shared<ops::MakeExtraOutput>();
  make->set_extra_output_channel(0, "r", false);
  auto add = std::make_shared<ops::AddExtraInput>();
  add->set_extra_input_channel(0, "r");
  OperationFuser f({make, std::make_shared<ops::ConstantScale>(2.0), add});
  expect_error_contains([&] { f.forward(x, {}); }, "outside its forward fusion");
}

TEST(Channels, LockCountsHolders) {
  auto make = std::make_shared<ops::MakeExtraOutput>();
  {
    OperationFuser a({make});
    OperationFuser b({make});
    EXPECT_TRUE(make->channels_locked());
    expect_error_contains([&] { make->set_extra_output_channel(0, "x"); },
                          "already captured its channel routing");
  }
  EXPECT_FALSE(make->channels_locked());
  make->set_extra_output_channel(0, "x");
  fuser::FuserOptions throwaway;
  throwaway.lock_channels = false;
  OperationFuser c({make}, throwaway);
  EXPECT_FALSE(make->channels_locked());
}

}  // namespace
}  // namespace fusible::test

namespace fusible::test {
namespace {

TEST(Channels, SequentialNeverRunsStaleGroupsAfterAFailedBuild) {
  fuser::Sequential seq;
  auto add = std::make_shared<ops::AddExtraInput>();
  add->set_extra_input_channel(0, "r");
  seq.push_back(add);
  const auto x = at::randn({3}, at::kDouble);
  const auto r = at::randn({3}, at::kDouble);
  EXPECT_TRUE(at::equal(seq.run(x, {}, {{"r", r}}).outputs[0], x + r));
  expect_error_contains([&] { seq.run(x, {}, {}); }, "has no producer");
  EXPECT_FALSE(add->channels_locked());
  EXPECT_TRUE(at::equal(seq.run(x, {}, {{"r", r}}).outputs[0], x + r));
  EXPECT_TRUE(add->channels_locked());
  seq.push_back(std::make_shared<ops::Identity>());  // a structure change releases the lock
  EXPECT_FALSE(add->channels_locked());
}

}  // namespace
}  // namespace fusible::test

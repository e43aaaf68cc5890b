// FP8 autocast from C++: the RAII guard, BasicLinear's casts under it, the recipe fixed at the
// forward for the backward, delayed-scaling state kept on the op and copied with it.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>

#include "test_utils.h"

namespace fusible {
namespace {

std::shared_ptr<const ops::Fp8Recipe> recipe(std::string kind, std::string fwd, std::string bwd) {
  auto r = std::make_shared<ops::Fp8Recipe>();
  r->kind = std::move(kind);
  r->forward_format = std::move(fwd);
  r->backward_format = std::move(bwd);
  r->amax_history_len = 3;
  return r;
}

// Reference cast (float64): scale = max / amax, through ATen's FP8 dtype.
at::Tensor qdq(const at::Tensor& x, at::ScalarType fp8, double max) {
  const double amax = x.abs().max().item<double>();
  const double scale = amax > 0 ? max / amax : 1.0;
  return (x * scale).clamp(-max, max).to(fp8).to(at::kDouble) / scale;
}

TEST(Fp8Autocast, GuardSetsAndRestoresThreadState) {
  EXPECT_FALSE(ops::fp8_autocast().enabled);
  {
    const ops::Fp8AutocastGuard on(true, recipe("current", "e4m3", "e5m2"));
    EXPECT_TRUE(ops::fp8_autocast().enabled);
    {
      const ops::Fp8AutocastGuard off(false, nullptr);
      EXPECT_FALSE(ops::fp8_autocast().enabled);
    }
    EXPECT_EQ(ops::fp8_autocast().recipe->backward_format, "e5m2");
  }
  EXPECT_FALSE(ops::fp8_autocast().enabled);
  EXPECT_THROW(ops::Fp8AutocastGuard(true, recipe("mxfp8", "e4m3", "e4m3")), c10::ValueError);
  EXPECT_THROW(ops::Fp8AutocastGuard(true, recipe("current", "e3m4", "e4m3")), c10::ValueError);
  EXPECT_FALSE(ops::fp8_autocast().enabled);  // a refused guard changed nothing
}

TEST(Fp8Autocast, LinearCastsOperandsAndGradient) {
  at::manual_seed(0);
  auto lin = std::make_shared<ops::BasicLinear>(8, 4, c10::Device(c10::kCPU), at::kDouble);
  fuser::OperationFuser fuser({lin});
  const auto x = at::randn({3, 8}, at::kDouble).requires_grad_();
  const auto dy = at::randn({3, 4}, at::kDouble);
  at::Tensor y;
  {
    const ops::Fp8AutocastGuard on(true, recipe("current", "e4m3", "e5m2"));
    y = fuser.forward(x, {})[0];
  }
  y.backward(dy);  // outside the guard: the forward's recipe decides
  const auto w = lin->weight().detach();
  const auto xq = qdq(x.detach(), at::kFloat8_e4m3fn, 448);
  const auto wq = qdq(w, at::kFloat8_e4m3fn, 448);
  const auto dyq = qdq(dy, at::kFloat8_e5m2, 57344);
  EXPECT_TRUE(at::allclose(y, xq.matmul(wq.t()), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(x.grad(), dyq.matmul(wq), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(lin->weight().grad(), dyq.t().matmul(xq), 1e-12, 1e-12));
  EXPECT_FALSE(at::allclose(y, x.detach().matmul(w.t()), 1e-6, 1e-6));  // the casts happened
}

TEST(Fp8Autocast, DelayedScalingStateLivesOnTheOpAndIsCopied) {
  auto lin = std::make_shared<ops::BasicLinear>(8, 4, c10::Device(c10::kCPU), at::kFloat);
  fuser::OperationFuser fuser({lin});
  EXPECT_EQ(lin->fp8_state(), nullptr);
  {
    const ops::Fp8AutocastGuard on(true, recipe("delayed", "e4m3", "e5m2"));
    const at::NoGradGuard no_grad;
    fuser.forward(at::randn({2, 8}) * 4, {});
  }
  const auto state = lin->fp8_state();
  ASSERT_NE(state, nullptr);
  ASSERT_EQ(state->forward.size(), 2u);
  ASSERT_EQ(state->backward.size(), 1u);
  EXPECT_EQ(state->forward[0].amax_history.size(0), 3);
  EXPECT_GT(state->forward[0].amax_history[0].item<float>(), 0.f);  // the input's amax entered
  EXPECT_NE(state->forward[0].scale.item<float>(), 1.f);            // and set the next scale
  auto copy = std::dynamic_pointer_cast<ops::BasicLinear>(lin->clone());
  ASSERT_NE(copy->fp8_state(), nullptr);
  EXPECT_NE(copy->fp8_state(), state);
  EXPECT_TRUE(
      at::equal(copy->fp8_state()->forward[0].amax_history, state->forward[0].amax_history));
  EXPECT_NE(copy->fp8_state()->forward[0].scale.data_ptr(), state->forward[0].scale.data_ptr());
}

TEST(Fp8Autocast, RecipeKeyRoundTrips) {
  EXPECT_EQ(ops::recipe_key(nullptr), "");
  EXPECT_EQ(ops::recipe_from_key(""), nullptr);
  auto r = std::make_shared<ops::Fp8Recipe>(*recipe("delayed", "e4m3", "e5m2"));
  r->margin = 0.1;  // not exact in binary: the key must keep every bit
  r->amax_compute_algo = "most_recent";
  r->x_block_dim = 2;
  r->min_tokens = 64;
  r->amax_reduction_group = {"tp;1 x", 4, 3};  // a name may hold the separator and spaces
  const auto back = ops::recipe_from_key(ops::recipe_key(r.get()));
  ASSERT_NE(back, nullptr);
  EXPECT_EQ(ops::recipe_key(back.get()), ops::recipe_key(r.get()));
  EXPECT_EQ(back->margin, 0.1);
  EXPECT_EQ(back->amax_history_len, 3);
  EXPECT_EQ(back->amax_compute_algo, "most_recent");
  EXPECT_EQ(back->x_block_dim, 2);
  EXPECT_EQ(back->min_tokens, 64);
  EXPECT_EQ(back->amax_reduction_group.name, "tp;1 x");
  EXPECT_EQ(back->amax_reduction_group.size, 4);
  EXPECT_EQ(back->amax_reduction_group.rank, 3);
  const auto plain = std::make_shared<ops::Fp8Recipe>(*recipe("delayed", "e4m3", "e5m2"));
  const auto plain_back = ops::recipe_from_key(ops::recipe_key(plain.get()));
  ASSERT_NE(plain_back, nullptr);
  EXPECT_EQ(plain_back->amax_reduction_group.size, 1);
  EXPECT_TRUE(plain_back->amax_reduction_group.name.empty());
  EXPECT_THROW(ops::recipe_from_key("delayed;e4m3"), c10::ValueError);
  EXPECT_THROW(ops::recipe_from_key("delayed;e4m3;e5m2;0;3;max;1;2;1"), c10::ValueError);
  EXPECT_THROW(ops::recipe_from_key("delayed;e4m3;e5m2;0;3;max;1;2;1;0;2;5;cpu;g"),
               c10::ValueError);  // rank 5 of 2
  EXPECT_THROW(ops::recipe_from_key("delayed;e4m3;e5m2;0;3;max;1;2;1;0;2;1;g"), c10::ValueError);
  EXPECT_THROW(ops::recipe_from_key("mxfp8;e4m3;e5m2;0;3;max;1;2;1;0"), c10::ValueError);
}

// A compiled call's backward recomputes its forward: under delayed scaling it must cast with the
// forward's scales and leave the forward histories as the forward left them.
TEST(Fp8Autocast, ReplayCastsAsTheForwardDidWithoutAdvancingHistories) {
  at::manual_seed(0);
  auto lin = std::make_shared<ops::BasicLinear>(8, 4, c10::Device(c10::kCPU), at::kFloat);
  fuser::OperationFuser fuser({lin});
  const auto r = recipe("delayed", "e4m3", "e5m2");
  const ops::Fp8AutocastGuard on(true, r);
  const auto states = [&] {
    return std::vector<ops::OpFp8State>{{lin->fp8_state(), lin->num_quantizers()}};
  };
  const auto x = at::randn({2, 8}) * 4;
  // No state yet: the first forward makes fresh ones (scale 1).
  EXPECT_TRUE(at::equal(ops::delayed_forward_scales(states(), c10::kCPU), at::ones({2})));
  {
    const at::NoGradGuard no_grad;
    fuser.forward(x, {});
  }
  const auto scales = ops::delayed_forward_scales(states(), c10::kCPU);
  EXPECT_FALSE(at::equal(scales, at::ones({2})));
  at::Tensor y;
  {
    const at::NoGradGuard no_grad;
    y = fuser.forward(x * 3, {})[0];  // casts with `scales`, then moves the scales on
  }
  const auto history = lin->fp8_state()->forward[0].amax_history.clone();
  const auto next = lin->fp8_state()->forward[0].scale.clone();
  EXPECT_FALSE(at::equal(next, scales.narrow(0, 0, 1)));
  {
    const ops::Fp8ReplayGuard replay(states(), scales);
    EXPECT_TRUE(at::equal(fuser.forward(x * 3, {})[0], y));
  }
  EXPECT_TRUE(at::equal(lin->fp8_state()->forward[0].amax_history, history));
  EXPECT_TRUE(at::equal(lin->fp8_state()->forward[0].scale, next));
  EXPECT_THROW(ops::Fp8ReplayGuard(states(), at::ones({3})), c10::Error);
}

}  // namespace
}  // namespace fusible

// Deferred initialization from C++: ops built on kMeta materialize in place on the first forward.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include "test_utils.h"

namespace fusible::test {
namespace {

TEST(DeferredInit, LinearOnMetaMaterializesInPlaceOnFirstForward) {
  auto lin = std::make_shared<ops::Linear>(8, 4, true, c10::Device(c10::kMeta), at::kDouble);
  const auto params = lin->parameters();
  ASSERT_EQ(params.size(), 2u);
  for (const auto& p : params) EXPECT_TRUE(p.is_meta());
  torch::optim::SGD opt(lin->parameters(), torch::optim::SGDOptions(0.5));
  std::vector<const c10::TensorImpl*> impls;
  for (const auto& p : params) impls.push_back(p.unsafeGetTensorImpl());

  fuser::OperationFuser f({lin});
  const auto x = at::randn({3, 8}, at::kDouble).requires_grad_();
  const auto y = f.forward(x, {})[0];
  y.sum().backward();

  const auto after = lin->parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_EQ(after[i].unsafeGetTensorImpl(), impls[i]);  // the same tensor objects
    EXPECT_EQ(after[i].device().type(), c10::kCPU);
    EXPECT_TRUE(after[i].grad().defined());
  }
  EXPECT_EQ(lin->weight().unsafeGetTensorImpl(), lin->linear_op()->weight().unsafeGetTensorImpl());
  EXPECT_TRUE(at::equal(lin->bias_op()->bias(), at::zeros({4}, at::kDouble)));
  EXPECT_LE(lin->weight().abs().max().item<double>(), 1 / std::sqrt(8.0));
  const auto expected = at::linear(x, lin->weight(), lin->bias_op()->bias());
  EXPECT_TRUE(at::allclose(y, expected, 1e-12, 1e-12));
  const auto w0 = lin->weight().detach().clone();
  opt.step();
  EXPECT_TRUE(at::allclose(lin->weight(), w0 - 0.5 * lin->weight().grad(), 0, 0));
}

TEST(DeferredInit, ResetParametersMaterializesOnDefaultDevice) {
  auto ln =
      std::make_shared<ops::LayerNorm>(std::vector<int64_t>{6}, 1e-5, c10::Device(c10::kMeta));
  const auto* impl = ln->weight().unsafeGetTensorImpl();
  ln->reset_parameters();
  EXPECT_EQ(ln->weight().unsafeGetTensorImpl(), impl);
  EXPECT_EQ(ln->weight().device().type(), at::hasCUDA() ? c10::kCUDA : c10::kCPU);
  EXPECT_TRUE(at::equal(ln->weight().cpu(), at::ones({6})));
}

}  // namespace
}  // namespace fusible::test

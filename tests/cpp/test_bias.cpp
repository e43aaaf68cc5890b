// bias_fwd / bias_bwd: the CPU reference against float64, argument errors, and CUDA against CPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#include "kernels/dispatch.h"
#include "test_utils.h"

namespace fusible::test {
namespace {

TEST(BiasCpu, ForwardMatchesFloat64Reference) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const auto x = at::randn({3, 5, 7}, at::dtype(dtype));
    const auto b = at::randn({7}, at::dtype(dtype));
    const auto y = kernels::bias_fwd(x, b);
    const auto ref = x.to(at::kDouble) + b.to(at::kDouble);
    expect_close(y, ref, dtype, /*gemm=*/false);
  }
}

TEST(BiasCpu, BackwardSumsLeadingDims) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    const auto dy = at::randn({4, 6, 9}, at::dtype(dtype));
    const auto db = kernels::bias_bwd(dy);
    ASSERT_EQ(db.sizes(), at::IntArrayRef({9}));
    expect_close(db, dy.to(at::kDouble).sum(at::IntArrayRef{0, 1}), dtype, /*gemm=*/false);
  }
}

TEST(BiasCpu, OneDimInputAndEmptyRows) {
  const auto x = at::randn({5}, at::kDouble);
  const auto b = at::randn({5}, at::kDouble);
  EXPECT_TRUE(at::equal(kernels::bias_fwd(x, b), x + b));
  const auto empty = at::randn({0, 4}, at::kDouble);
  EXPECT_TRUE(at::equal(kernels::bias_bwd(empty), at::zeros({4}, at::kDouble)));
}

TEST(BiasCpu, BadArgumentsGiveClearErrors) {
  const auto x = at::randn({2, 3});
  expect_error_contains([&] { kernels::bias_fwd(x, at::randn({4})); },
                        "bias_fwd: expected x.size(-1) == 4, got 3");
  expect_error_contains([&] { kernels::bias_fwd(x, at::randn({3}, at::kDouble)); }, "same dtype");
  expect_error_contains(
      [&] {
        kernels::bias_fwd(x, at::randn({1, 3}));
      },
      "expected bias to have 1 dims");
  expect_error_contains(
      [&] {
        kernels::bias_fwd(at::ones({2, 3}, at::kLong), at::ones({3}, at::kLong));
      },
      "floating-point");
  expect_error_contains([&] { kernels::bias_bwd(at::randn({})); }, "at least 1 dims");
}

class BiasCuda : public ::testing::TestWithParam<std::tuple<at::ScalarType, std::vector<int64_t>>> {
};

TEST_P(BiasCuda, MatchesCpuReference) {
  FUSIBLE_SKIP_WITHOUT_CUDA();
  const auto [dtype, shape] = GetParam();
  const auto x = at::randn(shape, at::dtype(at::kDouble));
  const auto b = at::randn({shape.back()}, at::dtype(at::kDouble));
  const auto dy = at::randn(shape, at::dtype(at::kDouble));
  const auto y = kernels::bias_fwd(x.to(dtype).cuda(), b.to(dtype).cuda());
  expect_close(y.cpu(), x.to(dtype).to(at::kDouble) + b.to(dtype).to(at::kDouble), dtype, false);
  const auto db = kernels::bias_bwd(dy.to(dtype).cuda());
  const auto ref = dy.to(dtype).to(at::kDouble).reshape({-1, shape.back()}).sum(0);
  // A sum over many rows rounds once per add in fp32: allow the reduction's growth.
  expect_close(db.cpu(), ref, dtype, /*gemm=*/true);
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndShapes, BiasCuda,
    ::testing::Combine(::testing::Values(at::kFloat, at::kHalf, at::kBFloat16, at::kDouble),
                       ::testing::Values(std::vector<int64_t>{7}, std::vector<int64_t>{33, 65},
                                         std::vector<int64_t>{4, 1024, 96},
                                         std::vector<int64_t>{8192, 130})));

}  // namespace
}  // namespace fusible::test

// The cuBLASLt GEMM layer on the GPU machine: each CUDA linear op against a float64 reference
// computed from the same (rounded) inputs, for bf16 / fp16 / fp32, both transposes (dgrad and
// wgrad), every epilogue, beta = 1 (a residual accumulated, out of place and in place), and odd
// sizes (which fall back to the ATen path). Skipped without CUDA.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>

#include <tuple>

namespace fusible::test {
namespace {

using Case = std::tuple<at::ScalarType, std::tuple<int64_t, int64_t, int64_t>>;  // dtype, (M, N, K)

class GemmCuda : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    std::tie(dtype_, std::ignore) = GetParam();
    std::tie(m_, n_, k_) = std::get<1>(GetParam());
  }
  at::Tensor rand(std::vector<int64_t> shape) {
    return at::randn(shape, at::TensorOptions().dtype(dtype_).device(at::kCUDA)) * 0.5;
  }
  // actual (in dtype) against ref (float64): within a tolerance relative to the output's scale.
  void expect_close(const at::Tensor& actual, const at::Tensor& ref, const char* what) {
    const double rtol = dtype_ == at::kFloat ? 1e-3 : dtype_ == at::kHalf ? 4e-3 : 2e-2;
    const auto a = actual.to(at::kDouble).cpu();
    const auto r = ref.to(at::kDouble).cpu();
    ASSERT_EQ(a.sizes(), r.sizes()) << what;
    const double scale = std::max(r.abs().max().item<double>(), 1e-6);
    const double err = (a - r).abs().max().item<double>();
    EXPECT_LE(err, rtol * scale) << what << ": max error " << err << " at scale " << scale;
  }
  static at::Tensor d64(const at::Tensor& t) { return t.to(at::kDouble); }
  at::ScalarType dtype_ = at::kFloat;
  int64_t m_ = 0, n_ = 0, k_ = 0;
};

at::Tensor gelu_tanh(const at::Tensor& t) { return at::gelu(t, "tanh"); }
at::Tensor dgelu_tanh(const at::Tensor& t) {
  const auto x = t.clone().requires_grad_();
  gelu_tanh(x).sum().backward();
  return x.grad();
}

TEST_P(GemmCuda, ForwardDgradWgradWithAlpha) {
  const auto x = rand({m_, k_}), w = rand({n_, k_}), b = rand({n_}), dy = rand({m_, n_});
  expect_close(kernels::linear_fwd(x, w, b), at::linear(d64(x), d64(w), d64(b)), "linear_fwd");
  expect_close(kernels::linear_fwd(x, w, std::nullopt), at::linear(d64(x), d64(w)), "no bias");
  expect_close(kernels::linear_bias_act(x, w, b, "relu"),
               at::relu(at::linear(d64(x), d64(w), d64(b))), "RELU_BIAS");
  expect_close(kernels::linear_dgrad(dy, w, 0.5), 0.5 * at::matmul(d64(dy), d64(w)), "dgrad");
  expect_close(kernels::linear_wgrad(dy, x, -2.0), -2.0 * at::matmul(d64(dy).t(), d64(x)), "wgrad");
}

TEST_P(GemmCuda, GeluBiasGeluAuxBiasAndDGeluBGrad) {
  const auto x = rand({m_, k_}), w = rand({n_, k_}), b = rand({n_});
  const auto pre_ref = at::linear(d64(x), d64(w), d64(b));
  auto [y, pre] = kernels::linear_bias_act_fwd(x, w, b, "gelu");
  expect_close(pre, pre_ref, "GELU_AUX_BIAS pre");
  expect_close(y, gelu_tanh(pre_ref), "GELU_AUX_BIAS y");
  expect_close(kernels::linear_bias_act(x, w, b, "gelu"), gelu_tanh(pre_ref), "GELU_BIAS");
  const auto w2 = rand({k_, n_}), dy = rand({m_, k_});
  auto [dpre, dbias] = kernels::linear_dgrad_act_bias(dy, w2, pre, "gelu");
  const auto dpre_ref = at::matmul(d64(dy), d64(w2)) * dgelu_tanh(d64(pre));
  expect_close(dpre, dpre_ref, "DGELU_BGRAD dpre");
  expect_close(dbias, dpre_ref.sum(0), "DGELU_BGRAD dbias");
}

TEST_P(GemmCuda, ResidualWithBetaOne) {
  const auto x = rand({m_, k_}), w = rand({n_, k_}), b = rand({n_}), r = rand({m_, n_});
  const auto ref = 0.25 * at::matmul(d64(x), d64(w).t()) + d64(b) + d64(r);
  expect_close(kernels::linear_add(x, w, b, r, 0.25), ref, "linear_add");
  const auto out = r.clone();
  kernels::linear_add_(out, x, w, b, 0.25);
  expect_close(out, ref, "linear_add_ (in place)");
  const auto dy = rand({m_, n_}), other = rand({m_, k_});
  expect_close(kernels::linear_dgrad_add(dy, w, other, 1.0),
               at::matmul(d64(dy), d64(w)) + d64(other), "linear_dgrad_add");
}

INSTANTIATE_TEST_SUITE_P(DtypesAndShapes, GemmCuda,
                         ::testing::Combine(::testing::Values(at::kBFloat16, at::kHalf, at::kFloat),
                                            ::testing::Values(std::make_tuple(64, 128, 96),
                                                              std::make_tuple(256, 64, 512),
                                                              std::make_tuple(33, 65, 17),
                                                              std::make_tuple(1, 8, 8))));

}  // namespace
}  // namespace fusible::test

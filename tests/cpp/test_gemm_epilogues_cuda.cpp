// The cuBLASLt layer's gradient epilogues that no kernel op uses, called directly: RELU_AUX_BIAS
// (ReLU with its bit mask kept), DRELU_BGRAD (the ReLU gradient from that mask, with the bias
// gradient), DGELU_BGRAD (slower on the H200 than our own pass, see linear/linear_cuda.cpp) and
// BGRADB (a wgrad GEMM that also sums dy over rows), each against a float64 reference. Skipped
// without CUDA.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <tuple>

#ifdef FUSIBLE_WITH_CUDA  // a build without CUDA has no cuBLASLt layer to test
#include "kernels/gemm/cublaslt_gemm.h"

namespace fusible::test {
namespace {

using Case = std::tuple<at::ScalarType, std::tuple<int64_t, int64_t, int64_t>>;  // dtype, (M, N, K)

class GemmEpilogues : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    std::tie(dtype_, std::ignore) = GetParam();
    std::tie(m_, n_, k_) = std::get<1>(GetParam());
  }
  at::Tensor rand(std::vector<int64_t> shape) {
    return at::randn(shape, at::TensorOptions().dtype(dtype_).device(at::kCUDA)) * 0.5;
  }
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

// The mask's bits as a float64 [rows, n] tensor of 0 / 1 (bit j of a row: byte j / 8, bit j % 8).
at::Tensor unpack_mask(const at::Tensor& mask, int64_t n) {
  const auto shifts = at::arange(8, mask.options().dtype(at::kInt));
  const auto bits =
      at::bitwise_and(at::bitwise_right_shift(mask.to(at::kInt).unsqueeze(-1), shifts), 1);
  return bits.reshape({mask.size(0), -1}).narrow(1, 0, n).to(at::kDouble);
}

TEST_P(GemmEpilogues, ReluAuxBiasThenDReluBGrad) {
  using kernels::gemm::Epilogue;
  const auto x = rand({m_, k_}), w = rand({n_, k_}), b = rand({n_});
  kernels::gemm::RowMajorGemm fwd;
  fwd.a = x;
  fwd.b = w;
  fwd.trans_b = true;
  fwd.d = at::empty({m_, n_}, x.options());
  fwd.epilogue = Epilogue::kReluAuxBias;
  fwd.bias = b;
  // Poisoned, so every byte the test reads must have been written (padding bits excepted).
  fwd.aux =
      at::full({m_, kernels::gemm::relu_mask_row_bytes(n_)}, 0xA5, x.options().dtype(at::kByte));
  ASSERT_TRUE(kernels::gemm::can_run(fwd));
  kernels::gemm::run(fwd);
  const auto pre = at::linear(d64(x), d64(w), d64(b));
  expect_close(fwd.d, at::relu(pre), "RELU_AUX_BIAS d");
  // The mask equals pre > 0 wherever pre is clearly away from zero (rounding decides the rest).
  const auto mask = unpack_mask(fwd.aux.cpu(), n_);
  const auto clear = pre.abs().cpu() > 0.05;
  EXPECT_TRUE(
      at::equal(mask.masked_select(clear), (pre.cpu() > 0).to(at::kDouble).masked_select(clear)))
      << "RELU_AUX_BIAS mask";

  const auto dy = rand({m_, k_}), w2 = rand({k_, n_});
  kernels::gemm::RowMajorGemm bwd;
  bwd.a = dy;
  bwd.b = w2;
  bwd.d = at::empty({m_, n_}, x.options());
  bwd.epilogue = Epilogue::kDReluBGrad;
  bwd.bias = at::empty({n_}, x.options());
  bwd.aux = fwd.aux;
  ASSERT_TRUE(kernels::gemm::can_run(bwd));
  kernels::gemm::run(bwd);
  const auto dpre = at::matmul(d64(dy), d64(w2)) * mask.to(at::kCUDA);
  expect_close(bwd.d, dpre, "DRELU_BGRAD d");
  expect_close(bwd.bias, dpre.sum(0), "DRELU_BGRAD bias");
}

TEST_P(GemmEpilogues, DGeluBGrad) {
  // d = gelu_tanh'(aux) * (dy @ w2), bias = d summed over rows.
  const auto dy = rand({m_, k_}), w2 = rand({k_, n_}), pre = rand({m_, n_});
  kernels::gemm::RowMajorGemm g;
  g.a = dy;
  g.b = w2;
  g.d = at::empty({m_, n_}, dy.options());
  g.epilogue = kernels::gemm::Epilogue::kDGeluBGrad;
  g.aux = pre;
  g.bias = at::empty({n_}, dy.options());
  if (!kernels::gemm::can_run(g)) GTEST_SKIP() << "GELU aux leading dim not a multiple of 8";
  kernels::gemm::run(g);
  const auto x = d64(pre).clone().requires_grad_();
  at::gelu(x, "tanh").sum().backward();
  const auto dpre = at::matmul(d64(dy), d64(w2)) * x.grad();
  // cuBLASLt's GELU gradient is accurate to 16-bit storage (2e-5 absolute in fp32, measured).
  const double tol = dtype_ == at::kFloat ? 1e-4 : dtype_ == at::kHalf ? 4e-3 : 2e-2;
  const double scale = dpre.abs().max().item<double>();
  EXPECT_LE((g.d.to(at::kDouble) - dpre).abs().max().item<double>(), tol * scale)
      << "DGELU_BGRAD d";
  EXPECT_LE((g.bias.to(at::kDouble) - dpre.sum(0)).abs().max().item<double>(),
            tol * std::max(dpre.sum(0).abs().max().item<double>(), scale))
      << "DGELU_BGRAD bias";
}

TEST_P(GemmEpilogues, WgradWithBGradB) {
  // dW [n, k] = dy^T x with dy [m, n], x [m, k]; the bias gradient is dy summed over its rows.
  const auto dy = rand({m_, n_}), x = rand({m_, k_});
  kernels::gemm::RowMajorGemm g;
  g.a = dy;
  g.trans_a = true;
  g.b = x;
  g.d = at::empty({n_, k_}, x.options());
  g.epilogue = kernels::gemm::Epilogue::kBGradB;
  g.bias = at::full({n_}, 1e4, x.options());  // poisoned
  ASSERT_TRUE(kernels::gemm::can_run(g));
  kernels::gemm::run(g);
  expect_close(g.d, at::matmul(d64(dy).t(), d64(x)), "BGRADB d");
  expect_close(g.bias, d64(dy).sum(0), "BGRADB bias");
}

INSTANTIATE_TEST_SUITE_P(DtypesAndShapes, GemmEpilogues,
                         ::testing::Combine(::testing::Values(at::kBFloat16, at::kHalf, at::kFloat),
                                            ::testing::Values(std::make_tuple(64, 128, 96),
                                                              std::make_tuple(256, 64, 512),
                                                              std::make_tuple(8, 200, 16),
                                                              std::make_tuple(1, 8, 8))));

}  // namespace
}  // namespace fusible::test
#endif

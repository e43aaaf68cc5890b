// The native CUDA kernels from C++ (kernels:: handles, the same dispatcher path as Python): each
// norm and elementwise op on CUDA against the same op on CPU in float64, from the same rounded
// inputs. The pytest suite (test_cuda_kernels.py) covers every kind and shape; this proves the C++
// entry points reach the same kernels. Skipped without CUDA.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>

namespace fusible::test {
namespace {

class NativeKernels : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
  at::Tensor rand(std::vector<int64_t> shape) {
    return at::randn(shape, at::TensorOptions().device(at::kCUDA)).to(GetParam());
  }
  static at::Tensor ref(const at::Tensor& t) { return t.to(at::kDouble).cpu(); }
  void expect_close(const at::Tensor& actual, const at::Tensor& ref64, const char* what) {
    const auto dtype = GetParam();
    const double rtol = dtype == at::kBFloat16 ? 1.6e-2 : dtype == at::kHalf ? 1e-3 : 1.3e-6;
    const auto a = actual.to(at::kDouble).cpu();
    const auto r = ref64.to(dtype).to(at::kDouble);
    EXPECT_TRUE(at::allclose(a, r, rtol, 1e-5))
        << what << ": max error " << (a - r).abs().max().item<double>();
  }
};

TEST_P(NativeKernels, LayerNormAndRMSNormForwardBackward) {
  const auto x = rand({13, 264}), w = rand({264}), b = rand({264}), dy = rand({13, 264});
  auto [y, mean, rstd] = kernels::layernorm_fwd(x, w, b, 1e-5, false);
  auto [ry, rmean, rrstd] = kernels::layernorm_fwd(ref(x), ref(w), ref(b), 1e-5, false);
  expect_close(y, ry, "layernorm y");
  auto [dx, dw, db] = kernels::layernorm_bwd(dy, x, mean, rstd, w, false);
  auto [rdx, rdw, rdb] = kernels::layernorm_bwd(ref(dy), ref(x), rmean, rrstd, ref(w), false);
  expect_close(dx, rdx, "layernorm dx");
  expect_close(dw, rdw, "layernorm dweight");
  expect_close(db, rdb, "layernorm dbias");
  auto [ys, rs] = kernels::rmsnorm_fwd(x, w, 1e-5, true);
  auto [rys, rrs] = kernels::rmsnorm_fwd(ref(x), ref(w), 1e-5, true);
  expect_close(ys, rys, "rmsnorm y");
  const auto extra = rand({13, 264});
  auto [dxs, dws] = kernels::rmsnorm_bwd_add(dy, x, rs, w, true, extra);
  auto [rdxs, rdws] = kernels::rmsnorm_bwd(ref(dy), ref(x), rrs, ref(w), true);
  expect_close(dxs, rdxs + ref(extra), "rmsnorm_bwd_add dx");
  expect_close(dws, rdws, "rmsnorm_bwd_add dweight");
}

TEST_P(NativeKernels, ActivationsGluScaleAdd) {
  const auto x = rand({9, 70}), dy = rand({9, 70}), dyh = rand({9, 35});
  expect_close(kernels::activation_fwd(x, "gelu"), kernels::activation_fwd(ref(x), "gelu"), "gelu");
  expect_close(kernels::activation_bwd(dy, x, "silu"),
               kernels::activation_bwd(ref(dy), ref(x), "silu"), "silu backward");
  expect_close(kernels::glu_fwd(x, "swiglu"), kernels::glu_fwd(ref(x), "swiglu"), "swiglu");
  expect_close(kernels::glu_bwd(dyh, x, "geglu"), kernels::glu_bwd(ref(dyh), ref(x), "geglu"),
               "geglu backward");
  expect_close(kernels::scale_fwd(x, 0.75), ref(x) * 0.75, "scale");
  expect_close(kernels::add_fwd(x, dy), ref(x) + ref(dy), "add");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NativeKernels,
                         ::testing::Values(at::kBFloat16, at::kHalf, at::kFloat));

}  // namespace
}  // namespace fusible::test

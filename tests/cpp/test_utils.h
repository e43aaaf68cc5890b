// Shared gtest helpers: float64-reference tolerances, error-message matching, CUDA skips.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "ops/fusion_registry.h"

namespace fusible::test {

struct Tolerance {
  double rtol;
  double atol;
};

/// Tolerance against a float64 reference for a result computed in dtype (the same table as
/// tests/python/conftest.py).
inline Tolerance tolerance_for(at::ScalarType dtype, bool gemm, bool cuda = false) {
  switch (dtype) {
    case at::kDouble:
      return {1e-12, 1e-12};
    case at::kFloat:
      return gemm ? Tolerance{cuda ? 1e-3 : 1e-4, 1e-5} : Tolerance{1.3e-6, 1e-5};
    case at::kHalf:
      return {1e-3, 1e-5};
    case at::kBFloat16:
      return {1.6e-2, 1e-5};
    default:
      return {0, 0};
  }
}

/// Compares actual (any dtype) with a float64 reference, with the tolerance of `dtype`.
/// Low-precision results are compared after rounding the reference to that dtype, as the
/// reference itself can only be represented that precisely.
inline void expect_close(const at::Tensor& actual, const at::Tensor& ref, at::ScalarType dtype,
                         bool gemm, bool cuda = false) {
  ASSERT_EQ(actual.sizes(), ref.sizes());
  const auto tol = tolerance_for(dtype, gemm, cuda);
  const auto a = actual.to(at::kDouble).cpu();
  const auto r = ref.to(dtype).to(at::kDouble).cpu();
  const auto err = (a - r).abs();
  const auto bound = tol.atol + tol.rtol * r.abs();
  const bool ok = (err <= bound).all().item<bool>();
  EXPECT_TRUE(ok) << "max abs error " << err.max().item<double>() << " (rtol " << tol.rtol
                  << ", atol " << tol.atol << ")";
}

/// Runs f and expects a c10::Error whose message contains `phrase`.
inline void expect_error_contains(const std::function<void()>& f, const std::string& phrase) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing \"" << phrase << "\"";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(phrase), std::string::npos)
        << "message was: " << e.what_without_backtrace();
  }
}

// Restores the fusion registry when a test ends, so registrations do not leak between tests.
struct RegistryGuard {
  std::vector<ops::FusionEntry> saved = ops::FusionRegistry::instance().snapshot();
  ~RegistryGuard() { ops::FusionRegistry::instance().restore(saved); }
};

#define FUSIBLE_SKIP_WITHOUT_CUDA()                                       \
  do {                                                                    \
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)

}  // namespace fusible::test

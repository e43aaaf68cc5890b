// Parameters are call inputs: a fuser computes with and differentiates the parameters a call
// passes; double backward raises; the C++ Sequential slices parameters per group, rejects unused
// named inputs and runs isolated ops through its `around` callback.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <type_traits>
#include <utility>

namespace fusible::test {
namespace {

using fuser::OperationFuser;

std::shared_ptr<ops::Linear> cpu_linear(int64_t in, int64_t out) {
  return std::make_shared<ops::Linear>(in, out, true, c10::Device(c10::kCPU), at::kDouble);
}

TEST(CallParameters, ComputeWithAndDifferentiateTheCallsTensors) {
  auto lin = cpu_linear(4, 3);
  OperationFuser f({lin});
  const auto x = at::randn({2, 4}, at::kDouble);
  const auto w = at::randn({3, 4}, at::kDouble).requires_grad_();
  const auto b = at::randn({3}, at::kDouble).requires_grad_();
  const auto y = f.forward(x, {}, {}, std::vector<at::Tensor>{w, b})[0];
  EXPECT_TRUE(at::allclose(y, at::linear(x, w, b), 1e-12, 1e-12));
  y.sum().backward();
  EXPECT_TRUE(at::allclose(w.grad(), x.sum(0).expand({3, 4}), 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(b.grad(), at::full({3}, 2.0, at::kDouble), 0, 0));
  EXPECT_FALSE(lin->weight().grad().defined());  // the registered weight was not used
}

// The accessors hand out the registered tensors read-only: assigning through one would make the
// ops compute with a tensor parameters() does not list (set_data and copy_ replace the values).
template <typename T>
constexpr bool read_only = std::is_const_v<std::remove_reference_t<T>>;
static_assert(read_only<decltype(std::declval<ops::Linear&>().weight())>);
static_assert(read_only<decltype(std::declval<ops::BasicLinear&>().weight())>);
static_assert(read_only<decltype(std::declval<ops::Bias&>().bias())>);
static_assert(read_only<decltype(std::declval<ops::LayerNorm&>().weight())>);
static_assert(read_only<decltype(std::declval<ops::LayerNorm&>().bias())>);
static_assert(read_only<decltype(std::declval<ops::RMSNorm&>().weight())>);

// te.ops' op_kwargs buffers from C++: ops::CallBuffersGuard hands GroupedLinear the caller's
// output tensor for the calls made while it lives; the output is that tensor.
TEST(CallParameters, GroupedLinearWritesIntoTheCallersOutputBuffer) {
  auto op =
      std::make_shared<ops::GroupedLinear>(2, 4, 3, true, c10::Device(c10::kCPU), at::kDouble);
  {
    at::NoGradGuard no_grad;
    for (auto& p : op->parameters()) p.normal_();
  }
  OperationFuser f({op});
  const auto x = at::randn({5, 4}, at::kDouble);
  const auto sizes = at::tensor(std::vector<int64_t>{2, 3});
  const auto plain = f.forward(x, {sizes})[0];
  auto out = at::full({5, 3}, std::nan(""), at::kDouble);
  at::Tensor y;
  {
    const ops::CallBuffersGuard buffers(op.get(), {out, at::Tensor()});
    y = f.forward(x, {sizes})[0];
  }
  EXPECT_EQ(y.data_ptr(), out.data_ptr());
  EXPECT_TRUE(at::equal(out, plain));
  EXPECT_NE(f.forward(x, {sizes})[0].data_ptr(), out.data_ptr());  // the guard is gone
  const ops::CallBuffersGuard bad(op.get(), {at::empty({5, 4}, at::kDouble), at::Tensor()});
  EXPECT_THROW(f.forward(x, {sizes}), c10::ValueError);
}

TEST(CallParameters, WrongCountOrShapeIsAClearError) {
  OperationFuser f({cpu_linear(4, 3)});
  const auto x = at::randn({2, 4}, at::kDouble);
  EXPECT_THROW(f.forward(x, {}, {}, std::vector<at::Tensor>{at::randn({3, 4}, at::kDouble)}),
               c10::ValueError);
  try {
    f.forward(x, {}, {},
              std::vector<at::Tensor>{at::randn({3, 5}, at::kDouble), at::randn({3}, at::kDouble)});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected parameter 'weight' of shape [3, 4]"),
              std::string::npos)
        << e.what();
  }
}

TEST(CallParameters, DoubleBackwardRaises) {
  OperationFuser f({std::make_shared<ops::LayerNorm>(std::vector<int64_t>{4}, 1e-5,
                                                     c10::Device(c10::kCPU), at::kDouble)});
  const auto x = at::randn({3, 4}, at::kDouble).requires_grad_();
  const auto y = f.forward(x, {})[0];
  try {
    torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("LayerNorm"), std::string::npos) << e.what();
  }
}

TEST(CallParameters, SequentialSlicesParametersPerGroup) {
  fuser::Sequential seq;
  seq.push_back(cpu_linear(4, 4));
  seq.push_back([](const at::Tensor& t) { return at::tanh(t); }, "Tanh");
  seq.push_back(cpu_linear(4, 2));
  const auto x = at::randn({3, 4}, at::kDouble);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{4, 4}, {4}, {2, 4}, {2}}) {
    params.push_back(at::randn(shape, at::kDouble));
  }
  const auto y = seq.run(x, {}, {}, params).outputs[0];
  const auto ref = at::linear(at::tanh(at::linear(x, params[0], params[1])), params[2], params[3]);
  EXPECT_TRUE(at::allclose(y, ref, 1e-12, 1e-12));
  EXPECT_THROW(seq.run(x, {}, {}, std::vector<at::Tensor>(params.begin(), params.end() - 1)),
               c10::ValueError);
}

TEST(CallParameters, SequentialRejectsUnusedNamedInputs) {
  fuser::Sequential seq({std::make_shared<ops::ConstantScale>(2.0)});
  const auto x = at::randn({2, 3});
  try {
    seq.run(x, {}, {{"nobody", x}});
    FAIL() << "expected an error";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("feed no bound input"), std::string::npos) << e.what();
  }
}

TEST(CallParameters, SequentialRunsIsolatedOpsThroughAround) {
  fuser::Sequential seq({std::make_shared<ops::ConstantScale>(2.0),
                         std::make_shared<ops::ConstantScale>(3.0),
                         std::make_shared<ops::ConstantScale>(5.0)});
  seq.set_isolated({false, true, false});
  std::vector<size_t> seen;
  const fuser::Sequential::AroundFn around = [&](size_t entry, const at::Tensor& x,
                                                 const std::vector<at::Tensor>& extras,
                                                 const fuser::Sequential::GroupRunner& run) {
    seen.push_back(entry);
    auto out = run(x, extras, std::nullopt);
    out[0] = out[0] + 1;  // a hook may replace the output
    return out;
  };
  const auto x = at::randn({2, 3}, at::kDouble);
  const auto y = seq.run(x, {}, {}, std::nullopt, around).outputs[0];
  EXPECT_EQ(seen, std::vector<size_t>{1});
  EXPECT_TRUE(at::allclose(y, ((x * 2) * 3 + 1) * 5, 1e-12, 1e-12));
  EXPECT_EQ(seq.fusion_plan().size(), 3u);  // the isolated op is a group of its own
}

}  // namespace
}  // namespace fusible::test

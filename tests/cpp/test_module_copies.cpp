// C++ modules keep torch::nn::Module's promises: clone() is a deep copy that computes the same with
// its own parameters and channels (held by no fuser yet), and torch::save / torch::load round-trip.
#include <ATen/ATen.h>
#include <fusible/fusible.h>
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>

namespace fusible::test {
namespace {

std::shared_ptr<fuser::Sequential> residual_mlp(c10::Device cpu = c10::Device(c10::kCPU)) {
  auto make = std::make_shared<ops::MakeExtraOutput>();
  auto add = std::make_shared<ops::AddExtraInput>();
  make->set_extra_output_channel(0, "residual", /*output_to_caller=*/false);
  add->set_extra_input_channel(0, "residual");
  return std::make_shared<fuser::Sequential>(std::vector<std::shared_ptr<ops::FusibleOperation>>{
      make, std::make_shared<ops::LayerNorm>(std::vector<int64_t>{6}, 1e-5, cpu, at::kDouble),
      std::make_shared<ops::Linear>(6, 12, true, cpu, at::kDouble), std::make_shared<ops::GELU>(),
      std::make_shared<ops::Linear>(12, 6, true, cpu, at::kDouble), add});
}

TEST(ModuleCopies, CloneIsDeepAndComputesTheSame) {
  auto model = residual_mlp();
  const auto x = at::randn({3, 6}, at::kDouble);
  const auto y = model->forward(x)[0];
  auto copy = std::dynamic_pointer_cast<fuser::Sequential>(model->clone());
  ASSERT_TRUE(copy);
  const auto a = model->parameters(), b = copy->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NE(a[i].data_ptr(), b[i].data_ptr());
    EXPECT_TRUE(at::equal(a[i], b[i]));
  }
  EXPECT_TRUE(at::equal(copy->forward(x)[0], y));  // channels copied too
  auto lin = std::dynamic_pointer_cast<ops::Linear>(copy->children()[2]);
  ASSERT_TRUE(lin);
  EXPECT_EQ(lin->weight().unsafeGetTensorImpl(), lin->linear_op()->weight().unsafeGetTensorImpl());
  {
    const at::NoGradGuard no_grad;
    for (auto& p : copy->parameters()) p.add_(1.0);
  }
  EXPECT_TRUE(at::equal(model->forward(x)[0], y));  // the original is untouched
  EXPECT_FALSE(at::equal(copy->forward(x)[0], y));
}

TEST(ModuleCopies, CloneOfAHeldOpIsNotLocked) {
  auto op = std::make_shared<ops::MakeExtraOutput>();
  fuser::OperationFuser holder({op});
  ASSERT_TRUE(op->channels_locked());
  auto copy = std::dynamic_pointer_cast<ops::MakeExtraOutput>(op->clone());
  ASSERT_TRUE(copy);
  EXPECT_FALSE(copy->channels_locked());
  copy->set_extra_output_channel(0, "elsewhere");
}

TEST(ModuleCopies, SaveAndLoadRoundTrip) {
  auto model = residual_mlp(), other = residual_mlp();
  {
    const at::NoGradGuard no_grad;
    for (auto& p : other->parameters()) p.normal_();
  }
  std::stringstream stream;
  torch::save(model, stream);
  torch::load(other, stream);
  const auto x = at::randn({2, 6}, at::kDouble);
  EXPECT_TRUE(at::equal(other->forward(x)[0], model->forward(x)[0]));
}

// LibTorch's load gives a parameter of another device the loaded tensor (set_data): a model built
// on meta (deferred) computes with the checkpoint, not with a first-forward initialization.
TEST(ModuleCopies, LoadIntoAMetaModelTakesTheCheckpoint) {
  auto model = residual_mlp();
  {
    const at::NoGradGuard no_grad;  // every parameter random (a zero bias would hide a lost one)
    for (auto& p : model->parameters()) p.normal_();
  }
  auto deferred = residual_mlp(c10::Device(c10::kMeta));
  for (const auto& p : deferred->parameters()) ASSERT_TRUE(p.is_meta());
  std::stringstream stream;
  torch::save(model, stream);
  torch::load(deferred, stream);
  for (const auto& p : deferred->parameters()) EXPECT_FALSE(p.is_meta());
  const auto x = at::randn({2, 6}, at::kDouble);
  EXPECT_TRUE(at::equal(deferred->forward(x)[0], model->forward(x)[0]));
}

// A load that fails part way leaves the deferred parameters on meta, as they were: real ones would
// hold uninitialized memory that no first forward initializes.
TEST(ModuleCopies, AFailedLoadLeavesAMetaModelOnMeta) {
  auto no_bias = std::make_shared<ops::Linear>(6, 12, false, c10::Device(c10::kCPU), at::kDouble);
  auto deferred = std::make_shared<ops::Linear>(6, 12, true, c10::Device(c10::kMeta), at::kDouble);
  std::stringstream stream;
  torch::save(no_bias, stream);  // the weight is there (made real first), the bias is not
  EXPECT_ANY_THROW(torch::load(deferred, stream));
  for (const auto& p : deferred->parameters()) EXPECT_TRUE(p.is_meta());
}

}  // namespace
}  // namespace fusible::test

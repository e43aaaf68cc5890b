// kernels::carve: tensors over parts of one allocation (a small FP8 cast's scale_inv beside its
// scratch, on CUDA), tested on the CPU: offsets, shapes, dtypes, contiguity, the shared storage.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "kernels/common/carved_tensor.h"

namespace fusible::test {
namespace {

TEST(CarvedTensor, ViewsTheBytesAtItsOffsetWithItsShapeAndDtype) {
  auto buffer = at::zeros({64 + 16 + 8}, at::dtype(at::kByte));
  const auto data = kernels::carve(buffer, 0, {4, 8}, at::kFloat8_e4m3fn);
  const auto data_t = kernels::carve(buffer, 32, {8, 4}, at::kFloat8_e4m3fn);
  const auto scale = kernels::carve(buffer, 64, {1}, at::kFloat);
  EXPECT_EQ(data.sizes(), at::IntArrayRef({4, 8}));
  EXPECT_EQ(data_t.sizes(), at::IntArrayRef({8, 4}));
  EXPECT_EQ(data.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(scale.scalar_type(), at::kFloat);
  EXPECT_TRUE(data.is_contiguous() && data_t.is_contiguous() && scale.is_contiguous());
  EXPECT_EQ(data.storage_offset(), 0);
  EXPECT_EQ(data_t.storage_offset(), 32);
  EXPECT_EQ(scale.storage_offset(), 16);  // in floats: byte 64
  auto* base = buffer.data_ptr<uint8_t>();
  EXPECT_EQ(static_cast<uint8_t*>(data_t.data_ptr()), base + 32);
  EXPECT_EQ(static_cast<uint8_t*>(scale.data_ptr()), base + 64);
  EXPECT_TRUE(data.storage().is_alias_of(buffer.storage()));

  // Writes land in their own bytes only.
  scale.fill_(2.5f);
  data_t.view(at::kByte).fill_(7);
  EXPECT_EQ(buffer.narrow(0, 0, 32).sum().item<int64_t>(), 0);
  EXPECT_EQ(buffer.narrow(0, 32, 32).sum().item<int64_t>(), 7 * 32);
  EXPECT_FLOAT_EQ(buffer.narrow(0, 64, 4).view(at::kFloat).item<float>(), 2.5f);
  EXPECT_EQ(buffer.narrow(0, 68, 20).sum().item<int64_t>(), 0);
}

TEST(CarvedTensor, OutlivesTheBufferHandleAndTakesEmptyShapes) {
  at::Tensor kept, empty;
  {
    auto buffer = at::full({16}, 3, at::dtype(at::kByte));
    kept = kernels::carve(buffer, 8, {2, 4}, at::kByte);
    empty = kernels::carve(buffer, 16, {0}, at::kByte);
  }
  EXPECT_EQ(kept.sum().item<int64_t>(), 3 * 8);  // the storage lives on with the carved tensor
  EXPECT_EQ(empty.numel(), 0);
}

}  // namespace
}  // namespace fusible::test

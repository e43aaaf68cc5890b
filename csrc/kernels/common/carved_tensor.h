// A tensor over part of a larger allocation, made without the dispatcher: an output and its
// kernel's scratch in one allocator call, where a call's host time, not its bytes, sets the pace
// (small tensors). Never two outputs of one op: outputs sharing a storage alias in its schema.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>

namespace fusible::kernels {

/// A contiguous tensor of `sizes` and `dtype` over `buffer`'s storage from byte `offset` on (a
/// multiple of dtype's size; the caller sized the buffer). It shares the storage, so the whole
/// buffer lives while any tensor carved from it does.
inline at::Tensor carve(const at::Tensor& buffer, int64_t offset, at::IntArrayRef sizes,
                        at::ScalarType dtype) {
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_INTERNAL_ASSERT(offset % item == 0, "carve: offset ", offset, " is not a multiple of ",
                        item);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(),
                                                   c10::scalarTypeToTypeMeta(dtype));
  impl->set_storage_offset(offset / item);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

}  // namespace fusible::kernels

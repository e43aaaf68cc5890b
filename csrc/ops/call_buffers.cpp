// CallBuffers: a per-thread list (a call hands buffers to few ops).
#include "ops/call_buffers.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/checks.h"

namespace fusible::ops {
namespace {

std::vector<std::pair<const BasicOperation*, CallBuffers>>& thread_buffers() {
  thread_local std::vector<std::pair<const BasicOperation*, CallBuffers>> buffers;
  return buffers;
}

}  // namespace

CallBuffersGuard::CallBuffersGuard(const BasicOperation* op, CallBuffers buffers) : op_(op) {
  thread_buffers().emplace_back(op, std::move(buffers));
}

CallBuffersGuard::~CallBuffersGuard() {
  auto& all = thread_buffers();
  const auto it =
      std::find_if(all.rbegin(), all.rend(), [&](const auto& entry) { return entry.first == op_; });
  if (it != all.rend()) all.erase(std::next(it).base());
}

CallBuffers call_buffers(const BasicOperation* op) {
  const auto& all = thread_buffers();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->first == op) return it->second;
  }
  return {};
}

void check_call_buffer(const char* op, const char* key, const at::Tensor& buffer,
                       c10::IntArrayRef shape, at::ScalarType dtype, c10::Device device) {
  TORCH_CHECK_VALUE(buffer.sizes() == shape && buffer.scalar_type() == dtype &&
                        buffer.device() == device && buffer.is_contiguous(),
                    op, ": expected the \"", key, "\" buffer as a contiguous tensor of shape ",
                    shape, ", dtype ", dtype, " on ", device, ", got shape ", buffer.sizes(),
                    ", dtype ", buffer.scalar_type(), " on ", buffer.device(),
                    buffer.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK_VALUE(!buffer.requires_grad(), op, ": expected the \"", key,
                    "\" buffer not to require grad (pass buffer.detach()), got one that does");
}

}  // namespace fusible::ops

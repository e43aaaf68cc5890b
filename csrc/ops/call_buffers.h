// Tensors a caller hands one op for one call, te.ops' op_kwargs buffers (GroupedLinear's "output"
// and "grad_input"): set on the calling thread around the call, read by the op's forward.
#pragma once

#include <ATen/core/Tensor.h>

namespace fusible::ops {

class BasicOperation;

/// Undefined where not given.
struct CallBuffers {
  /// The forward writes its output here and returns it.
  at::Tensor output;
  /// The backward writes the input's gradient here and returns it.
  at::Tensor grad_input;
};

/// Hands `buffers` to `op` for the calls this thread makes while the guard lives.
class CallBuffersGuard {
 public:
  CallBuffersGuard(const BasicOperation* op, CallBuffers buffers);
  ~CallBuffersGuard();
  CallBuffersGuard(const CallBuffersGuard&) = delete;
  CallBuffersGuard& operator=(const CallBuffersGuard&) = delete;

 private:
  const BasicOperation* op_;
};

/// The buffers handed to op on this thread (both undefined: none).
CallBuffers call_buffers(const BasicOperation* op);

/// Checks a caller's buffer against what the op computes: `shape`, `dtype`, `device`,
/// contiguous, not requiring grad (ValueError naming op and key otherwise).
void check_call_buffer(const char* op, const char* key, const at::Tensor& buffer,
                       c10::IntArrayRef shape, at::ScalarType dtype, c10::Device device);

}  // namespace fusible::ops

// The loop every built-in fusion function shares: walk the op list and replace matching windows.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "ops/basic/activations.h"
#include "ops/basic/basic_linear.h"
#include "ops/fusion_registry.h"

namespace fusible::ops {

/// The op at position i as a T, or null (past the end, or another type).
template <typename T>
std::shared_ptr<T> op_at(const OpList& ops, size_t i) {
  return i < ops.size() ? std::dynamic_pointer_cast<T>(ops[i]) : nullptr;
}

/// The BasicLinear at position i when its GEMMs are local (no tensor-parallel collectives, which
/// the fused GEMMs would skip), or null.
inline std::shared_ptr<BasicLinear> local_linear_at(const OpList& ops, size_t i) {
  auto linear = op_at<BasicLinear>(ops, i);
  return linear && !linear->is_tensor_parallel() ? linear : nullptr;
}

/// The GELU or ReLU op at position i (the activations GEMM epilogues have), or null.
inline std::shared_ptr<ElementwiseActivation> epilogue_activation_at(const OpList& ops, size_t i) {
  std::shared_ptr<ElementwiseActivation> act = op_at<GELU>(ops, i);
  if (!act) act = op_at<ReLU>(ops, i);
  // An epilogue keeps the pre-activation itself: not the FP8 input the op would cache.
  return act && !act->caches_quantized_input() ? act : nullptr;
}

/// At position i: the fused op for the window starting there and how many ops it replaces, or
/// {nullptr, 0} to keep ops[i].
using WindowMatch = std::function<std::pair<std::shared_ptr<FusibleOperation>, size_t>(
    const OpList& ops, size_t i)>;

inline OpList fuse_windows(const OpList& ops, const WindowMatch& match) {
  OpList out;
  out.reserve(ops.size());
  for (size_t i = 0; i < ops.size();) {
    auto [fused, n] = match(ops, i);
    if (fused) {
      out.push_back(std::move(fused));
      i += n;
    } else {
      out.push_back(ops[i++]);
    }
  }
  return out;
}

}  // namespace fusible::ops

// Autograd's dispatch keys back on inside code that runs below autograd (the fuser's passes, a
// kernel): user code there sees autograd as it would outside (a recompute under enable_grad).
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>

namespace fusible {

/// For its lifetime, the autograd keys are not excluded on this thread; the previous set after.
class AutogradKeysOn {
 public:
  AutogradKeysOn() : guard_(keys()) {}

 private:
  static c10::impl::LocalDispatchKeySet keys() {
    auto keys = c10::impl::tls_local_dispatch_key_set();
    keys.excluded_ = keys.excluded_ - c10::autograd_dispatch_keyset;
    return keys;
  }
  c10::impl::ForceDispatchKeyGuard guard_;
};

}  // namespace fusible

"""fusible's ops as TorchInductor fallbacks, registered when Inductor's lowering table loads.

Inductor has no lowering for a custom op, so it makes an implicit fallback the first time it meets
one; but first it formats the op's arguments for a log message, whether logged or not, and that
text spells out each argument's whole IR. An op whose input comes from a chain of other fallback
kernels (a loss after twelve transformer layers) expands the chain as a tree, exponentially in its
depth: the compile of the fusible gpt_small loss ran for minutes there. Registering every fusible
op up front gives the fallback Inductor would make (with the same layout constraint, from the
op's tags or Inductor's default for custom ops) without that message.

Importing torch._inductor costs most of a second, so nothing here imports it: a finder on
sys.meta_path waits for the lowering module's own import (a torch.compile's first lowering) and
registers the ops right after it ran. An import that happened before fusible's is handled at once.
"""

import importlib.abc
import importlib.util
import sys
import warnings

import torch

_LOWERING = "torch._inductor.lowering"


def fusible_overloads():
    """Every OpOverload registered in the fusible namespace (the C++ kernels and the fuser ops)."""
    out = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("fusible::"):
            continue
        name, _, overload = qualified.removeprefix("fusible::").partition(".")
        out.append(getattr(getattr(torch.ops.fusible, name), overload or "default"))
    return out


def register(lowering):
    """Registers each fusible op without a lowering as a fallback, as Inductor's implicit one."""
    for op in fusible_overloads():
        if op in lowering.lowerings:
            continue
        tag = lowering.get_layout_constraint_tag(op, with_default=True)
        lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))


class _AfterLoweringImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the lowering module it wraps the regular spec's exec_module so
    that register runs once the module is complete, then leaves sys.meta_path."""

    def find_spec(self, name, path, target=None):
        if name != _LOWERING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                register(module)
            except Exception as e:  # never break Inductor's import; compiles then only run slower
                warnings.warn(f"fusible: ops not registered as Inductor fallbacks: {e!r}")

        spec.loader.exec_module = exec_module
        return spec


def install():
    if _LOWERING in sys.modules:
        register(sys.modules[_LOWERING])
    elif not any(isinstance(f, _AfterLoweringImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoweringImport())

"""fusible.checkpoint: activation checkpointing whose recompute casts to FP8 as the forward did
(te.distributed.checkpoint's rule), on top of torch.utils.checkpoint."""

import contextlib

import torch

from . import _C, quantization

__all__ = ["checkpoint"]


class _Recompute:
    """The recompute's context: the forward's FP8 autocast (C++ and Python sides), and its delayed
    casts replayed from copies of the states they started from (no history update)."""

    def __init__(self, autocast_state, python_recipe, record):
        self._state, self._recipe, self._record = autocast_state, python_recipe, record

    def __enter__(self):
        replay = _C._Fp8ReplayScope(self._record)
        replay.__enter__()  # first: it may raise, before anything else changed
        self._replay = replay
        self._previous = _C._exchange_fp8_autocast(*self._state)
        self._previous_recipe = getattr(quantization._autocast_recipe, "value", None)
        self._previous_key = quantization._compiled_key
        quantization._autocast_recipe.value = self._recipe
        quantization._compiled_key = _C._fp8_recipe_key(self._state[1])

    def __exit__(self, *exc):
        quantization._autocast_recipe.value = self._previous_recipe
        quantization._compiled_key = self._previous_key
        _C._exchange_fp8_autocast(*self._previous)
        self._replay.__exit__(*exc)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def checkpoint(function, *args, use_reentrant=False, context_fn=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args)`` whose recompute in the backward
    runs under the FP8 autocast of the forward, whether or not the backward runs inside one, and
    casts as the forward did: DelayedScaling's casts take the scales the forward used and leave
    the amax histories alone (the forward already recorded them). The gradients are then those of
    the forward that ran. Plain ``torch.utils.checkpoint`` recomputes without FP8 where the
    backward runs outside the autocast, and with updated scales inside it.

    Only the non-reentrant form (``use_reentrant=False``); ``context_fn`` and the other keywords
    pass on to ``torch.utils.checkpoint``."""
    if use_reentrant:
        raise ValueError("fusible.checkpoint: only use_reentrant=False is supported")
    if torch.compiler.is_compiling():
        # torch's checkpoint under compile takes only TorchDispatchMode contexts.
        raise NotImplementedError(
            "fusible.checkpoint under torch.compile is not supported yet; checkpoint outside the "
            "compiled region, or use torch.utils.checkpoint there"
        )

    def contexts():
        state = _C._fp8_autocast_state()  # the forward's (enabled, recipe)
        python_recipe = getattr(quantization._autocast_recipe, "value", None)
        record = _C._Fp8Record()
        forward, recompute = (
            context_fn() if context_fn else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return (
            _both(forward, _C._Fp8RecordScope(record)),
            _both(recompute, _Recompute(state, python_recipe, record)),
        )

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )

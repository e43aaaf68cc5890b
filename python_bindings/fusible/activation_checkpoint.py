"""fusible.checkpoint: activation checkpointing whose recompute casts to FP8 as the forward did
(te.distributed.checkpoint's rule), on top of torch.utils.checkpoint."""

import contextlib

import torch

from . import _C

__all__ = ["checkpoint"]


class _Recompute:
    """The recompute's context: the forward's FP8 autocast, and its delayed casts replayed with
    the scales they used (no history update)."""

    def __init__(self, autocast_state, record):
        self._state, self._record = autocast_state, record

    def __enter__(self):
        self._replay = _C._Fp8ReplayScope(self._record)
        self._previous = _C._exchange_fp8_autocast(*self._state)
        self._replay.__enter__()

    def __exit__(self, *exc):
        self._replay.__exit__(*exc)
        _C._exchange_fp8_autocast(*self._previous)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def checkpoint(function, *args, use_reentrant=False, context_fn=None, **kwargs):
    """torch.utils.checkpoint.checkpoint(function, *args) whose recompute in the backward runs
    under the FP8 autocast of the forward, whether or not the backward runs inside one, and casts
    as the forward did: DelayedScaling's casts take the scales the forward used and leave the amax
    histories alone (the forward already recorded them). The gradients are then those of the
    forward that ran. Plain torch.utils.checkpoint recomputes without FP8 where the backward runs
    outside the autocast, and with updated scales inside it.

    Only the non-reentrant form (use_reentrant=False); context_fn and the other keywords pass on
    to torch.utils.checkpoint."""
    if use_reentrant:
        raise ValueError("fusible.checkpoint: only use_reentrant=False is supported")

    def contexts():
        state = _C._fp8_autocast_state()  # the forward's (enabled, recipe)
        record = _C._Fp8Record()
        forward, recompute = (
            context_fn() if context_fn else (contextlib.nullcontext(), contextlib.nullcontext())
        )
        return (
            _both(forward, _C._Fp8RecordScope(record)),
            _both(recompute, _Recompute(state, record)),
        )

    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=contexts, **kwargs
    )

"""FP8 entry points: `autocast`, `quantized_model_init`, `fp8_available` (API.md "Quantization").

The autocast state lives in C++, per thread (an op fixes the recipe at its forward; its backward
uses that one, wherever it runs). Under an enabled autocast, BasicLinear's GEMMs (and every fusion
built on it) compute with their operands cast to FP8 and back (fusible::fp8_quantize_dequantize):
the numerics of FP8 GEMMs, emulated on CPU and, for now, on CUDA too (the FP8 cuBLASLt GEMMs come
next).
"""

import contextlib

import torch

from . import _C
from . import recipe as _recipe


def fp8_available():
    """(True, "") when this machine's GPU runs FP8 GEMMs (compute capability 8.9 or newer), else
    (False, the reason)."""
    if not torch.cuda.is_available():
        return False, "FP8 needs a CUDA GPU; none is available"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return False, f"FP8 needs compute capability 8.9 or newer, this GPU has {major}.{minor}"
    return True, ""


def _cpp_recipe(recipe):
    if not isinstance(recipe, _recipe.Recipe):
        raise TypeError(
            f"fusible.autocast: expected a fusible.recipe recipe, got {type(recipe).__name__}"
        )
    fmt = recipe.fp8_format
    margin = float(getattr(recipe, "margin", 0))
    if recipe.delayed():
        algo = recipe.amax_compute_algo
        if callable(algo):
            raise NotImplementedError(
                "fusible.autocast: a callable amax_compute_algo is not supported yet; use 'max' "
                "or 'most_recent'"
            )
        if recipe.scaling_factor_compute_algo is not None:
            raise NotImplementedError(
                "fusible.autocast: scaling_factor_compute_algo is not supported yet"
            )
        return _C.Fp8Recipe(
            "delayed",
            fmt.forward_format,
            fmt.backward_format,
            margin,
            int(recipe.amax_history_len),
            algo,
        )
    return _C.Fp8Recipe(recipe._kind, fmt.forward_format, fmt.backward_format, margin)


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    """FP8 for the ops called inside (te's `autocast`). enabled=False is an exact no-op; recipe
    defaults to Float8CurrentScaling() (HYBRID)."""
    if calibrating:
        raise NotImplementedError("fusible.autocast: calibrating=True is not supported yet")
    if amax_reduction_group is not None:
        raise NotImplementedError(
            "fusible.autocast: amax_reduction_group is not supported yet (no distributed amax)"
        )
    cpp = None
    if enabled:
        cpp = _cpp_recipe(recipe if recipe is not None else _recipe.Float8CurrentScaling())
    prev = _C._exchange_fp8_autocast(bool(enabled), cpp)
    try:
        yield
    finally:
        _C._exchange_fp8_autocast(*prev)


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """Modules built inside store FP8 weights (te's `quantized_model_init`). enabled=False is an
    exact no-op."""
    if enabled:
        raise NotImplementedError(
            "fusible.quantized_model_init(enabled=True): FP8 weights are not supported yet"
        )
    yield

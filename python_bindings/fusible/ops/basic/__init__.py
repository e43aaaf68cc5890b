"""te.ops' `ops.basic` module: the basic operations, one module per op family as csrc/ops/basic/
has one file per family."""

import importlib

from ..op import BasicOperation

_FAMILIES = (
    "activations",
    "basic_linear",
    "bias",
    "collectives",
    "dropout",
    "extra_io",
    "grouped_linear",
    "norms",
    "quantize",
    "simple_ops",
)

__all__ = ["BasicOperation"]
for _name in _FAMILIES:
    _family = importlib.import_module(f"{__name__}.{_name}")
    globals().update({name: getattr(_family, name) for name in _family.__all__})
    __all__ += _family.__all__

"""te.ops-style fusible operations: every op is a torch.nn.Module backed by a C++ operation.

The modules mirror te.ops' (`op`, `basic`, `fused`, `fuser`, `linear`, `sequential`) and
csrc/ops/basic/ (one module per op family under `basic`)."""

import sys

from . import basic, fused, fuser, linear, op, sequential, state_dict
from .basic import *  # noqa: F403
from .fuser import *  # noqa: F403
from .linear import Linear
from .op import FusedOperation, FusibleOperation, OperationContext
from .sequential import Sequential
from .state_dict import full_state_dict, load_full_state_dict, te_ops_state_dict

__all__ = [
    *basic.__all__,
    *fuser.__all__,
    "FusedOperation",
    "FusibleOperation",
    "Linear",
    "OperationContext",
    "Sequential",
    "full_state_dict",
    "load_full_state_dict",
    "te_ops_state_dict",
    "basic",
    "fused",
    "fuser",
    "linear",
    "op",
    "sequential",
    "state_dict",
]

# Where fusible 0.1 defined its classes: pickles written by it name these modules.
for _old in ("_base", "_basic", "_collectives", "_containers"):
    sys.modules[f"{__name__}.{_old}"] = sys.modules[__name__]

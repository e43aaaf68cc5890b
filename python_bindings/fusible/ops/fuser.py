"""te.ops' `ops.fuser` module: the fuser and the fusion registry."""

from ._containers import OperationFuser
from ._fusions import (
    register_backward_fusion,
    register_forward_backward_fusion,
    register_forward_fusion,
    restore_fusions,
    snapshot_fusions,
    unregister_fusion,
)

__all__ = [
    "OperationFuser",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
    "restore_fusions",
    "snapshot_fusions",
    "unregister_fusion",
]

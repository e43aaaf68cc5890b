"""te.ops' `ops.op` module: the operation base classes and the per-call context."""

from .. import _C
from ._base import BasicOperation, FusedOperation, FusibleOperation

OperationContext = _C.OperationContext

__all__ = ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext"]

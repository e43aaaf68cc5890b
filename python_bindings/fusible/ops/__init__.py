"""te.ops-style fusible operations: every op is a torch.nn.Module backed by a C++ operation."""
from ._base import BasicOperation, FusedOperation, FusibleOperation
from ._basic import (GEGLU, GELU, GLU, QGEGLU, QGELU, SReGLU, SReLU, AddExtraInput, BasicLinear,
                     Bias, ClampedSwiGLU, ConstantScale, Dropout, Identity, L2Normalization,
                     LayerNorm, Linear, MakeExtraOutput, ReGLU, ReLU, Reshape, RMSNorm,
                     ScaledSwiGLU, SiLU, SwiGLU)
from ._containers import OperationFuser, Sequential
from ._fusions import (register_backward_fusion, register_forward_backward_fusion,
                       register_forward_fusion, restore_fusions, snapshot_fusions,
                       unregister_fusion)
from .. import _C as _core

OperationContext = _core.OperationContext
from . import fused

__all__ = [
    "AddExtraInput", "BasicLinear", "BasicOperation", "Bias", "ClampedSwiGLU", "ConstantScale",
    "Dropout", "FusedOperation", "FusibleOperation", "GEGLU", "GELU", "GLU", "Identity",
    "L2Normalization", "LayerNorm", "Linear", "MakeExtraOutput", "OperationFuser", "QGEGLU",
    "QGELU", "ReGLU", "ReLU", "Reshape", "RMSNorm", "SReGLU", "SReLU", "ScaledSwiGLU",
    "Sequential", "SiLU", "SwiGLU", "fused", "OperationContext", "register_forward_fusion",
    "register_backward_fusion", "register_forward_backward_fusion", "unregister_fusion",
    "snapshot_fusions", "restore_fusions",
]

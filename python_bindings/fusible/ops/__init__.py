"""te.ops-style fusible operations: every op is a torch.nn.Module backed by a C++ operation."""
from ._base import BasicOperation, FusedOperation, FusibleOperation
from ._basic import (GEGLU, GELU, GLU, QGEGLU, QGELU, SReGLU, SReLU, AddExtraInput, BasicLinear,
                     Bias, ClampedSwiGLU, ConstantScale, Dropout, Identity, L2Normalization,
                     LayerNorm, Linear, MakeExtraOutput, ReGLU, ReLU, Reshape, RMSNorm,
                     ScaledSwiGLU, SiLU, SwiGLU)
from ._containers import OperationFuser, Sequential
from . import fused

__all__ = [
    "AddExtraInput", "BasicLinear", "BasicOperation", "Bias", "ClampedSwiGLU", "ConstantScale",
    "Dropout", "FusedOperation", "FusibleOperation", "GEGLU", "GELU", "GLU", "Identity",
    "L2Normalization", "LayerNorm", "Linear", "MakeExtraOutput", "OperationFuser", "QGEGLU",
    "QGELU", "ReGLU", "ReLU", "Reshape", "RMSNorm", "SReGLU", "SReLU", "ScaledSwiGLU",
    "Sequential", "SiLU", "SwiGLU", "fused",
]

"""The built-in fused operations (csrc/ops/fused/builtin_fusions), as fuser.forward_ops() /
backward_ops() show them: modules over the C++ fused op a fusion made, with the user's own basic
ops in `basic_ops` (an nn.ModuleList)."""

import torch

from ..op import FusedOperation


class _BuiltinFused(FusedOperation):
    @classmethod
    def _from_plan(cls, cpp_op, basic_ops):
        """The Python face of a plan's fused op over the user's basic ops."""
        self = cls.__new__(cls)
        torch.nn.Module.__init__(self)
        # Not _attach: the C++ op must not point back at this short-lived face.
        self._cpp, self._fuser = cpp_op, None
        self.basic_ops = torch.nn.ModuleList(basic_ops)
        return self

    def _basic_op_list(self):
        return list(self.basic_ops)


_MADE_BY_PLANS = (
    "\n\nA plan makes it (fuser.forward_ops() / backward_ops() show it); not built by hand. "
    "basic_ops: the user's basic ops it replaces, in forward order."
)


def _fused(name, doc):
    return type(name, (_BuiltinFused,), {"__doc__": doc + _MADE_BY_PLANS, "__module__": __name__})


ForwardLinearBiasActivation = _fused(
    "ForwardLinearBiasActivation",
    "BasicLinear + Bias (+ GELU or ReLU) forward: one GEMM with the bias and the activation in its "
    "epilogue. Conditions: the Bias matches out_features and the weight's dtype.",
)
ForwardLinearBiasAdd = _fused(
    "ForwardLinearBiasAdd",
    "BasicLinear (+ Bias) + AddExtraInput(in_place=True) forward: one GEMM accumulating into the "
    "extra tensor (beta = 1).",
)
ForwardLinearBiasAddOutOfPlace = _fused(
    "ForwardLinearBiasAddOutOfPlace",
    "BasicLinear (+ Bias) + AddExtraInput(in_place=False) forward: one GEMM reading the extra "
    "tensor as its C input (beta = 1) into a new output (beyond te.ops).",
)
ForwardLinearScaleAdd = _fused(
    "ForwardLinearScaleAdd",
    "BasicLinear + ConstantScale + AddExtraInput(in_place=True) forward: one GEMM with "
    "alpha = scale accumulating into the extra tensor.",
)
BackwardLinearAdd = _fused(
    "BackwardLinearAdd",
    "MakeExtraOutput(in_place=True) + BasicLinear backward: the dgrad GEMM adds the extra "
    "output's gradient in its epilogue.",
)
BackwardLinearScale = _fused(
    "BackwardLinearScale",
    "BasicLinear + ConstantScale backward: dgrad and wgrad GEMMs with alpha = scale.",
)
BackwardActivationBias = _fused(
    "BackwardActivationBias",
    "Bias + GELU or ReLU backward: the activation's gradient and the bias gradient in one pass.",
)
BackwardLinearActivationBias = _fused(
    "BackwardLinearActivationBias",
    "Bias + GELU or ReLU + BasicLinear backward: the activation's gradient and the bias gradient "
    "in the epilogue of the linear's dgrad GEMM (beyond te.ops).",
)
BackwardAddRMSNorm = _fused(
    "BackwardAddRMSNorm",
    "MakeExtraOutput(in_place=False) + RMSNorm backward: the extra output's gradient added in the "
    "norm's backward.",
)
BackwardAddLayerNorm = _fused(
    "BackwardAddLayerNorm",
    "MakeExtraOutput(in_place=False) + LayerNorm backward: the extra output's gradient added in "
    "the norm's backward (the LayerNorm twin of BackwardAddRMSNorm, beyond te.ops).",
)

GroupedMLP_GroupedGEMMGLU = _fused(
    "GroupedMLP_GroupedGEMMGLU",
    "GroupedLinear + ScaledSwiGLU + GroupedLinear forward and backward (the MoE expert MLP): the "
    "grouped GEMMs of the unfused plan, with fc2's input recomputed by the activation's backward "
    "pass instead of kept (beyond te.ops, named in its GroupedMLP_* style).",
)

__all__ = [
    "BackwardActivationBias",
    "BackwardAddLayerNorm",
    "BackwardAddRMSNorm",
    "BackwardLinearActivationBias",
    "BackwardLinearAdd",
    "BackwardLinearScale",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearBiasAddOutOfPlace",
    "ForwardLinearScaleAdd",
    "GroupedMLP_GroupedGEMMGLU",
]

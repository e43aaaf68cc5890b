"""Quantize: casts to FP8 under an FP8 autocast (csrc/ops/basic/quantize)."""

from ... import _C, quantization
from ..op import BasicOperation


class Quantize(BasicOperation):
    """Casts x (forward=True) and/or the gradient dy (backward=True) to FP8 under an FP8
    autocast, with its recipe's formats; identity otherwise (te.ops' Quantize). Where its output
    leaves fusible (called alone, or last in a Sequential) under a per-tensor recipe, it is a
    Float8Tensor, as te.ops returns a quantized tensor: the next op's FP8 GEMM reads its data as
    it is, any other module sees its dequantized values. Inside a fuser group the next op gets the
    cast values, which its own cast leaves unchanged under current scaling (they are on the grid;
    under DelayedScaling the next op's own quantizer casts them again, where te.ops would read
    them as they are). Likewise the backward's gradient leaves fusible (Quantize called alone, or
    first in a Sequential) as a Float8Tensor under a per-tensor recipe; inside a group the op
    before it gets the cast values.

    Args:
        forward (bool): quantize the forward's tensor (default True).
        backward (bool): quantize the backward's gradient (default False).
    """

    _repr_fields = ()

    def __init__(self, forward=True, backward=False):  # positional too, as te.ops'
        # te.ops' attribute names (`forward` is the module's method).
        self._quantize_forward, self._quantize_backward = bool(forward), bool(backward)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.Quantize(self._quantize_forward, self._quantize_backward)

    def forward(self, input, *extra_inputs, **kwargs):
        if self._quantize_backward:  # its gradient leaves fusible here: handed on quantized
            input = quantization.quantized_grad(input, self._cpp)
        if not self._quantize_forward:
            return super().forward(input, *extra_inputs, **kwargs)
        scale = quantization.output_scale(self._cpp)
        y = super().forward(input, *extra_inputs, **kwargs)
        return quantization.quantized_output(y, scale)

    def extra_repr(self):
        return f"forward={self._quantize_forward}, backward={self._quantize_backward}"


__all__ = ["Quantize"]

"""Built-in fused operation classes, as they appear in fuser.forward_ops() / backward_ops()."""

from .._C import ForwardLinearBiasActivation

__all__ = ["ForwardLinearBiasActivation"]

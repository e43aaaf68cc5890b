"""Identity, Reshape and ConstantScale (csrc/ops/basic/simple_ops)."""

from .._args import size_arg
from ._faces import arg, as_float, make_face


def _shape(shape):
    return tuple(size_arg("Reshape", "shape", s) for s in shape)


Identity = make_face("Identity", "y = x. Saves nothing for backward.", module=__name__)

Reshape = make_face(
    "Reshape",
    """y = x.reshape(shape); the backward reshapes to the input's shape.

    Args:
        shape: the output shape; one entry may be -1.
    """,
    [arg("shape", convert=_shape, positional=True)],
    cpp_args=["shape"],
    aliases={"_shape": "shape"},
    module=__name__,
)

ConstantScale = make_face(
    "ConstantScale",
    """y = scale * x.

    Args:
        scale (float): the constant factor.
    """,
    [arg("scale", convert=as_float, positional=True)],
    cpp_args=["scale"],
    module=__name__,
)

__all__ = ["ConstantScale", "Identity", "Reshape"]

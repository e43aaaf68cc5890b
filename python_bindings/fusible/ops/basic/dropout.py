"""Dropout (csrc/ops/basic/dropout)."""

from ._faces import arg, as_float, make_face

Dropout = make_face(
    "Dropout",
    """Dropout with probability p in training mode, identity in eval mode.

    Args:
        p (float): probability of zeroing an element.
    """,
    [arg("p", convert=as_float, positional=True)],
    cpp_args=["p"],
    aliases={"dropout_probability": "p"},
    module=__name__,
)

__all__ = ["Dropout"]

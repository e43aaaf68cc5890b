"""AddExtraInput and MakeExtraOutput: tensors in and out of a fuser beside the main one
(csrc/ops/basic/extra_io)."""

from ._faces import arg, as_bool, make_face


def _in_place_face(name, summary, in_place):
    doc = f"""{summary}

    Args:
        in_place (bool): {in_place}
    """
    args = [arg("in_place", False, as_bool)]
    aliases = {"_in_place": "in_place"}
    return make_face(name, doc, args, cpp_args=["in_place"], aliases=aliases, module=__name__)


AddExtraInput = _in_place_face(
    "AddExtraInput",
    "y = x + extra (extra input 0).",
    "add into the extra tensor's storage and return it (RuntimeError where the extra tensor "
    "would have to broadcast to hold the sum); the add runs out of place (same values and "
    "dtype, a new tensor) for an extra tensor that is a channel's value, shares storage with "
    "x, another extra tensor or a parameter of the fuser call, or is a view in a call that "
    "records autograd history.",
)
MakeExtraOutput = _in_place_face(
    "MakeExtraOutput",
    "y = x and extra output 0 = x (the same tensor); dx = dy + d(extra).",
    "accumulate the extra gradient into dy's storage when it can.",
)

__all__ = ["AddExtraInput", "MakeExtraOutput"]

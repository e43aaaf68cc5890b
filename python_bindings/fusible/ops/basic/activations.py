"""The activations and the GLU family, plain and row-scaled (csrc/ops/basic/activations). Each
face is one row of the table below."""

from ._faces import (
    CACHE_DOC,
    INTERLEAVE_DOC,
    RECOMPUTE_DOC,
    REQUIRED,
    arg,
    as_bool,
    as_float,
    make_face,
)


def _doc(summary, *args):
    return summary + "\n\n    Args:\n" + "".join(f"        {a}\n" for a in args) + "    "


_CACHE = arg("cache_quantized_input", False, as_bool)
_INTERLEAVE = arg("glu_interleave_size", None)
_RECOMPUTE = arg("activation_recompute_in_mlp", False, as_bool)
_SCALES = "; scales (extra input 0) has x's shape without the last dim."


def _plain(name, summary):
    return make_face(name, _doc(summary, CACHE_DOC), [_CACHE], module=__name__)


def _gated(name, half):
    summary = f"the last dim splits into halves [a, b]; y = {half}(a) * b (the first half is gated)"
    return make_face(
        name, _doc(summary, INTERLEAVE_DOC, CACHE_DOC), [_CACHE, _INTERLEAVE], module=__name__
    )


GELU = _plain("GELU", "y = gelu(x), tanh approximation.")
QGELU = _plain("QGELU", "y = x * sigmoid(1.702 x).")
ReLU = _plain("ReLU", "y = max(x, 0).")
SReLU = _plain("SReLU", "y = max(x, 0)^2.")
SiLU = _plain("SiLU", "y = x * sigmoid(x).")
GLU = _gated("GLU", "sigmoid")
GEGLU = _gated("GEGLU", "gelu_tanh")
QGEGLU = _gated("QGEGLU", "qgelu")
ReGLU = _gated("ReGLU", "relu")
SReGLU = _gated("SReGLU", "srelu")
SwiGLU = _gated("SwiGLU", "silu")

_CLAMPED_ARGS = [
    arg("limit", 7.0, as_float),
    arg("alpha", 1.702, as_float),
    arg("glu_linear_offset", 1.0, as_float),
]
_CLAMPED_DOC = "limit (float), alpha (float), glu_linear_offset (float): as above."
_SITU_ARGS = [arg("beta1", 4.0, as_float), arg("beta2", 25.0, as_float)]
_SITU_DOC = "beta1, beta2 (float > 0): the gate's and the linear half's caps."

ClampedSwiGLU = make_face(
    "ClampedSwiGLU",
    _doc(
        "GPT-OSS SwiGLU: a = min(a, limit), b = clamp(b, -limit, limit),\n"
        "    y = a * sigmoid(alpha * a) * (b + glu_linear_offset).",
        _CLAMPED_DOC,
        INTERLEAVE_DOC,
        CACHE_DOC,
    ),
    [*_CLAMPED_ARGS, _CACHE, _INTERLEAVE],
    cpp_args=["limit", "alpha", "glu_linear_offset"],
    module=__name__,
)

SiTUGLU = make_face(
    "SiTUGLU",
    _doc(
        "SiTU GLU: y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) on halves [a, b]\n"
        "    (bounded by beta1 * beta2 in absolute value).",
        _SITU_DOC,
        INTERLEAVE_DOC,
        CACHE_DOC,
    ),
    [*_SITU_ARGS, _CACHE, _INTERLEAVE],
    cpp_args=["beta1", "beta2"],
    repr_fields=["beta1", "beta2", "glu_interleave_size"],
    module=__name__,
)

# The row-scaled forms (te.ops' MoE activations): glu_interleave_size positional, as te.ops'.
_POS_INTERLEAVE = arg("glu_interleave_size", None, positional=True)

ScaledSwiGLU = make_face(
    "ScaledSwiGLU",
    _doc("y = scales[..., None] * swiglu(x)" + _SCALES, INTERLEAVE_DOC, RECOMPUTE_DOC),
    [_POS_INTERLEAVE, _RECOMPUTE],
    module=__name__,
)

ScaledSiTUGLU = make_face(
    "ScaledSiTUGLU",
    _doc(
        "y = scales[..., None] * situglu(x) (SiTUGLU's formula)" + _SCALES,
        INTERLEAVE_DOC,
        _SITU_DOC,
        RECOMPUTE_DOC,
    ),
    [_POS_INTERLEAVE, _RECOMPUTE, *_SITU_ARGS],
    cpp_args=["beta1", "beta2"],
    repr_fields=["beta1", "beta2", "glu_interleave_size"],
    module=__name__,
)

ScaledClampedQGeGLU = make_face(
    "ScaledClampedQGeGLU",
    _doc(
        "y = scales[..., None] * ClampedSwiGLU's formula (te.ops' name for the clamped\n"
        "    quick-GELU GLU)" + _SCALES,
        INTERLEAVE_DOC,
        _CLAMPED_DOC,
        RECOMPUTE_DOC,
    ),
    [_POS_INTERLEAVE, _RECOMPUTE, *_CLAMPED_ARGS],
    cpp_args=["limit", "alpha", "glu_linear_offset"],
    repr_fields=["limit", "alpha", "glu_linear_offset", "glu_interleave_size"],
    module=__name__,
)
# te.ops' child ClampedSwiGLU, whose limit, alpha and offset its fusion functions read.
ScaledClampedQGeGLU._clamped = property(
    lambda self: ClampedSwiGLU(
        limit=self.limit, alpha=self.alpha, glu_linear_offset=self.glu_linear_offset
    )
)

ScaledSReLU = make_face(
    "ScaledSReLU",
    _doc("y = scales[..., None] * max(x, 0)^2" + _SCALES, RECOMPUTE_DOC),
    [_RECOMPUTE],
    module=__name__,
)

ScaledTanhSReLU = make_face(
    "ScaledTanhSReLU",
    _doc(
        "y = scales[..., None] * (c tanh(max(x, 0) / c))^2 with c = tanh_clamp_scale: a squared\n"
        "    ReLU saturating at c^2" + _SCALES,
        "tanh_clamp_scale (float > 0): c above (required, as in te.ops).",
        RECOMPUTE_DOC,
    ),
    [arg("tanh_clamp_scale", REQUIRED, as_float), _RECOMPUTE],
    cpp_args=["tanh_clamp_scale"],
    module=__name__,
)

__all__ = [
    "GEGLU",
    "GELU",
    "GLU",
    "QGEGLU",
    "QGELU",
    "ClampedSwiGLU",
    "ReGLU",
    "ReLU",
    "SReGLU",
    "SReLU",
    "ScaledClampedQGeGLU",
    "ScaledSReLU",
    "ScaledSiTUGLU",
    "ScaledSwiGLU",
    "ScaledTanhSReLU",
    "SiLU",
    "SiTUGLU",
    "SwiGLU",
]

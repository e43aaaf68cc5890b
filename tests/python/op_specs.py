"""One spec per basic op: how to build it for an input shape, and a float64 PyTorch reference.
test_basic_ops.py checks SPECS at their default shape; fuzz_chains.py chains every spec (SPECS and
GROUPED_SPECS) at random shapes."""

import math

import torch
import torch.nn.functional as F
from fusible import ops


def _halves(x):
    a, b = x.chunk(2, dim=-1)
    return a, b


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x) ** 2


def _clamped_swiglu(x, limit=7.0, alpha=1.702, offset=1.0):
    a, b = _halves(x)
    a = a.clamp(max=limit)
    b = b.clamp(-limit, limit)
    return a * torch.sigmoid(alpha * a) * (b + offset)


def _situglu(x, beta1=4.0, beta2=25.0):
    a, b = _halves(x)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


def _deinterleave(x, k):
    """te.ops' glu_interleave_size layout (blocks of k a-columns, then k b-columns) to [a | b]."""
    n = x.shape[-1]
    return x.reshape(-1, n // (2 * k), 2, k).transpose(1, 2).reshape(x.shape)


def _grouped_linear(x, p, e):
    """GroupedLinear: one linear per group of consecutive rows (e[0]: split sizes); with a second
    extra input (scale_bias), each row's bias times its scale."""
    rows = x.reshape(-1, x.shape[-1])
    groups = sum(1 for k in p if k.startswith("weight"))
    sizes = e[0].tolist()
    scales = e[1].split(sizes) if len(e) > 1 else [None] * groups
    parts = []
    for g, (xg, sg) in enumerate(zip(rows.split(sizes), scales)):
        yg = xg @ p[f"weight{g}"].T
        bias = p.get(f"bias{g}")
        if bias is not None:
            yg = yg + (bias if sg is None else sg.unsqueeze(-1) * bias)
        parts.append(yg)
    return torch.cat(parts).reshape(*x.shape[:-1], -1)


def extra_shape(kind, shape):
    """The shape of an extra tensor of that kind for an op whose input has `shape`."""
    if kind == "x":
        return tuple(shape)
    if kind == "rows":
        return tuple(shape[:-1])
    if kind == "flat_rows":
        return (math.prod(shape[:-1]),)
    raise ValueError(f"no fixed shape for extra tensors of kind {kind!r}")


def _same_shape(s, m):
    return tuple(s)


def _to_width(s, m):
    return (*s[:-1], m)


def _half_width(s, m):
    return (*s[:-1], s[-1] // 2)


def _flatten_rows(s, m):
    return (math.prod(s[:-1]), s[-1])


def _any_shape(s):
    return True


def _width_multiple_of(k):
    return lambda s: s[-1] % k == 0


class Spec:
    """One basic op and its float64 reference.

    build(device, dtype, shape, out_features, **options) -> the op for inputs of `shape`;
    ref(x, params, extras) -> (y, *extra_outputs) in float64.
    extras / extra_outputs: the kind of each extra-input / extra-output slot: "x" (x's shape),
    "rows" (x's shape less its last dim), "flat_rows" ([number of rows]) or "splits" (split sizes).
    out_shape(shape, out_features) -> y's shape; fits(shape): whether the op takes that input
    shape; options: constructor keywords that leave the reference unchanged, name -> values (the
    first is the default); kinked: its derivative jumps (ReLU, clamps).
    """

    def __init__(
        self,
        name,
        build,
        ref,
        shape=(3, 4, 16),
        extras=(),
        extra_outputs=(),
        gemm=False,
        exact=False,
        out_shape=_same_shape,
        fits=_any_shape,
        options=None,
        kinked=False,
    ):
        self.name, self.build, self.ref = name, build, ref
        self.shape, self.extras, self.extra_outputs = shape, extras, extra_outputs
        self.gemm, self.exact = gemm, exact
        self.out_shape, self.fits, self.options = out_shape, fits, options or {}
        self.kinked = kinked

    @property
    def extra_shapes(self):
        """The extra inputs' shapes at the default shape."""
        return tuple(extra_shape(kind, self.shape) for kind in self.extras)

    def make(self, device, dtype, shape=None, out_features=24, **options):
        return self.build(device, dtype, tuple(shape or self.shape), out_features, **options)

    def __repr__(self):
        return self.name


def _gated(cls, act, kinked=False):
    return Spec(
        cls.__name__,
        lambda d, t, s, m: cls(),
        lambda x, p, e: act(_halves(x)[0]) * _halves(x)[1],
        out_shape=_half_width,
        fits=_width_multiple_of(2),
        kinked=kinked,
    )


def _gated_spec(name, build, ref, interleave=1, **kwargs):
    """A GLU-family spec: halves the width, which must split into 2 * interleave blocks."""
    return Spec(
        name, build, ref, out_shape=_half_width, fits=_width_multiple_of(2 * interleave), **kwargs
    )


SPECS = [
    Spec("Identity", lambda d, t, s, m: ops.Identity(), lambda x, p, e: x, exact=True),
    Spec(
        "Reshape",
        lambda d, t, s, m: ops.Reshape((-1, s[-1])),
        lambda x, p, e: x.reshape(-1, x.shape[-1]),
        exact=True,
        out_shape=_flatten_rows,
    ),
    Spec("ConstantScale", lambda d, t, s, m: ops.ConstantScale(0.37), lambda x, p, e: 0.37 * x),
    Spec(
        "Bias",
        lambda d, t, s, m: ops.Bias(s[-1], device=d, dtype=t),
        lambda x, p, e: x + p["bias"],
    ),
    Spec(
        "BasicLinear",
        lambda d, t, s, m: ops.BasicLinear(s[-1], m, device=d, dtype=t),
        lambda x, p, e: x @ p["weight"].T,
        gemm=True,
        out_shape=_to_width,
    ),
    Spec(
        "Linear",
        lambda d, t, s, m: ops.Linear(s[-1], m, device=d, dtype=t),
        lambda x, p, e: x @ p["weight"].T + p["bias"],
        gemm=True,
        out_shape=_to_width,
    ),
    Spec(
        "LayerNorm",
        lambda d, t, s, m: ops.LayerNorm(s[-1], device=d, dtype=t),
        lambda x, p, e: F.layer_norm(x, p["weight"].shape, p["weight"], p["bias"], 1e-5),
    ),
    Spec(
        "LayerNorm2d",
        lambda d, t, s, m: ops.LayerNorm(s[-2:], device=d, dtype=t, zero_centered_gamma=True),
        lambda x, p, e: F.layer_norm(x, p["weight"].shape, p["weight"] + 1, p["bias"], 1e-5),
        fits=lambda s: len(s) >= 2,
    ),
    Spec(
        "RMSNorm",
        lambda d, t, s, m: ops.RMSNorm(s[-1], device=d, dtype=t),
        lambda x, p, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * p["weight"],
    ),
    Spec(
        "L2Normalization",
        lambda d, t, s, m: ops.L2Normalization(),
        lambda x, p, e: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6),
    ),
    Spec("GELU", lambda d, t, s, m: ops.GELU(), lambda x, p, e: _gelu(x)),
    Spec("QGELU", lambda d, t, s, m: ops.QGELU(), lambda x, p, e: _qgelu(x)),
    Spec("ReLU", lambda d, t, s, m: ops.ReLU(), lambda x, p, e: F.relu(x), kinked=True),
    Spec("SReLU", lambda d, t, s, m: ops.SReLU(), lambda x, p, e: _srelu(x)),
    Spec("SiLU", lambda d, t, s, m: ops.SiLU(), lambda x, p, e: F.silu(x)),
    _gated(ops.GLU, torch.sigmoid),
    _gated(ops.GEGLU, _gelu),
    _gated(ops.QGEGLU, _qgelu),
    _gated(ops.ReGLU, F.relu, kinked=True),
    _gated(ops.SReGLU, _srelu),
    _gated(ops.SwiGLU, F.silu),
    _gated_spec(
        "ClampedSwiGLU",
        lambda d, t, s, m: ops.ClampedSwiGLU(limit=1.5, alpha=1.3),
        lambda x, p, e: _clamped_swiglu(x, 1.5, 1.3),
        kinked=True,
    ),
    _gated_spec(
        "ScaledSwiGLU",
        lambda d, t, s, m: ops.ScaledSwiGLU(),
        lambda x, p, e: e[0].unsqueeze(-1) * F.silu(_halves(x)[0]) * _halves(x)[1],
        extras=("rows",),
    ),
    _gated_spec(
        "ClampedSwiGLU_offset_interleaved",
        lambda d, t, s, m: ops.ClampedSwiGLU(
            limit=1.5, alpha=1.3, glu_linear_offset=0.25, glu_interleave_size=4
        ),
        lambda x, p, e: _clamped_swiglu(_deinterleave(x, 4), 1.5, 1.3, 0.25),
        interleave=4,
        kinked=True,
    ),
    _gated_spec(
        "SwiGLU_interleaved",
        lambda d, t, s, m: ops.SwiGLU(glu_interleave_size=2),
        lambda x, p, e: F.silu(_halves(_deinterleave(x, 2))[0]) * _halves(_deinterleave(x, 2))[1],
        interleave=2,
    ),
    _gated_spec("SiTUGLU", lambda d, t, s, m: ops.SiTUGLU(), lambda x, p, e: _situglu(x)),
    _gated_spec(
        "SiTUGLU_small_betas_interleaved",
        lambda d, t, s, m: ops.SiTUGLU(beta1=0.7, beta2=1.2, glu_interleave_size=4),
        lambda x, p, e: _situglu(_deinterleave(x, 4), 0.7, 1.2),
        interleave=4,
    ),
    _gated_spec(
        "ScaledSwiGLU_interleaved",
        lambda d, t, s, m: ops.ScaledSwiGLU(8),
        lambda x, p, e: e[0].unsqueeze(-1)
        * F.silu(_halves(_deinterleave(x, 8))[0])
        * _halves(_deinterleave(x, 8))[1],
        extras=("rows",),
        interleave=8,
    ),
    _gated_spec(
        "ScaledSiTUGLU",
        lambda d, t, s, m: ops.ScaledSiTUGLU(beta1=0.9, beta2=1.5),
        lambda x, p, e: e[0].unsqueeze(-1) * _situglu(x, 0.9, 1.5),
        extras=("rows",),
    ),
    _gated_spec(
        "ScaledClampedQGeGLU_interleaved",
        lambda d, t, s, m: ops.ScaledClampedQGeGLU(
            4, limit=1.5, alpha=1.702, glu_linear_offset=0.5
        ),
        lambda x, p, e: e[0].unsqueeze(-1) * _clamped_swiglu(_deinterleave(x, 4), 1.5, 1.702, 0.5),
        extras=("rows",),
        interleave=4,
        kinked=True,
    ),
    Spec(
        "ScaledSReLU",
        lambda d, t, s, m: ops.ScaledSReLU(),
        lambda x, p, e: e[0].unsqueeze(-1) * _srelu(x),
        extras=("rows",),
    ),
    Spec(
        "ScaledTanhSReLU",
        lambda d, t, s, m: ops.ScaledTanhSReLU(tanh_clamp_scale=0.8),
        lambda x, p, e: e[0].unsqueeze(-1) * (0.8 * torch.tanh(F.relu(x) / 0.8)) ** 2,
        extras=("rows",),
    ),
    Spec(
        "AddExtraInput",
        lambda d, t, s, m, in_place=False: ops.AddExtraInput(in_place=in_place),
        lambda x, p, e: x + e[0],
        extras=("x",),
        exact=True,
        options={"in_place": (False, True)},
    ),
    Spec(
        "MakeExtraOutput",
        lambda d, t, s, m, in_place=False: ops.MakeExtraOutput(in_place=in_place),
        lambda x, p, e: (x, x),
        extra_outputs=("x",),
        exact=True,
        options={"in_place": (False, True)},
    ),
    Spec("DropoutEval", lambda d, t, s, m: ops.Dropout(0.3).eval(), lambda x, p, e: x, exact=True),
    Spec(
        "Quantize",
        lambda d, t, s, m, backward=False: ops.Quantize(backward=backward),
        lambda x, p, e: x,  # outside an FP8 autocast: the identity
        exact=True,
        options={"backward": (False, True)},
    ),
]

# Ops whose extra inputs include split sizes (integers, no gradient): test_grouped_linear.py
# checks them on their own; the fuzzer chains them with the rest.
GROUPED_SPECS = [
    Spec(
        "GroupedLinear",
        lambda d, t, s, m, bias=True: ops.GroupedLinear(3, s[-1], m, bias=bias, device=d, dtype=t),
        _grouped_linear,
        extras=("splits",),
        gemm=True,
        out_shape=_to_width,
        options={"bias": (True, False)},
    ),
    Spec(
        "GroupedLinear_scale_bias",
        lambda d, t, s, m: ops.GroupedLinear(3, s[-1], m, scale_bias=True, device=d, dtype=t),
        _grouped_linear,
        extras=("splits", "flat_rows"),
        gemm=True,
        out_shape=_to_width,
    ),
]

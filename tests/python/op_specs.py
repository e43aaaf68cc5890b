"""One spec per basic op: how to build it, an input shape, and a float64 PyTorch reference."""

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


class Spec:
    """make(device, dtype) -> op; ref(x, params, extras) -> (y, *extra_outputs) in float64."""

    def __init__(self, name, make, ref, shape=(3, 4, 16), extra_shapes=(), gemm=False, exact=False):
        self.name, self.make, self.ref = name, make, ref
        self.shape, self.extra_shapes, self.gemm, self.exact = shape, extra_shapes, gemm, exact

    def __repr__(self):
        return self.name


def _gated(cls, act):
    return Spec(
        cls.__name__, lambda d, t: cls(), lambda x, p, e: act(_halves(x)[0]) * _halves(x)[1]
    )


SPECS = [
    Spec("Identity", lambda d, t: ops.Identity(), lambda x, p, e: x, exact=True),
    Spec(
        "Reshape", lambda d, t: ops.Reshape((12, -1)), lambda x, p, e: x.reshape(12, -1), exact=True
    ),
    Spec("ConstantScale", lambda d, t: ops.ConstantScale(0.37), lambda x, p, e: 0.37 * x),
    Spec("Bias", lambda d, t: ops.Bias(16, device=d, dtype=t), lambda x, p, e: x + p["bias"]),
    Spec(
        "BasicLinear",
        lambda d, t: ops.BasicLinear(16, 24, device=d, dtype=t),
        lambda x, p, e: x @ p["weight"].T,
        gemm=True,
    ),
    Spec(
        "Linear",
        lambda d, t: ops.Linear(16, 24, device=d, dtype=t),
        lambda x, p, e: x @ p["weight"].T + p["bias"],
        gemm=True,
    ),
    Spec(
        "LayerNorm",
        lambda d, t: ops.LayerNorm(16, device=d, dtype=t),
        lambda x, p, e: F.layer_norm(x, (16,), p["weight"], p["bias"], 1e-5),
    ),
    Spec(
        "LayerNorm2d",
        lambda d, t: ops.LayerNorm((4, 16), device=d, dtype=t, zero_centered_gamma=True),
        lambda x, p, e: F.layer_norm(x, (4, 16), p["weight"] + 1, p["bias"], 1e-5),
    ),
    Spec(
        "RMSNorm",
        lambda d, t: ops.RMSNorm(16, device=d, dtype=t),
        lambda x, p, e: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * p["weight"],
    ),
    Spec(
        "L2Normalization",
        lambda d, t: ops.L2Normalization(),
        lambda x, p, e: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6),
    ),
    Spec("GELU", lambda d, t: ops.GELU(), lambda x, p, e: _gelu(x)),
    Spec("QGELU", lambda d, t: ops.QGELU(), lambda x, p, e: _qgelu(x)),
    Spec("ReLU", lambda d, t: ops.ReLU(), lambda x, p, e: F.relu(x)),
    Spec("SReLU", lambda d, t: ops.SReLU(), lambda x, p, e: _srelu(x)),
    Spec("SiLU", lambda d, t: ops.SiLU(), lambda x, p, e: F.silu(x)),
    _gated(ops.GLU, torch.sigmoid),
    _gated(ops.GEGLU, _gelu),
    _gated(ops.QGEGLU, _qgelu),
    _gated(ops.ReGLU, F.relu),
    _gated(ops.SReGLU, _srelu),
    _gated(ops.SwiGLU, F.silu),
    Spec(
        "ClampedSwiGLU",
        lambda d, t: ops.ClampedSwiGLU(limit=1.5, alpha=1.3),
        lambda x, p, e: _clamped_swiglu(x, 1.5, 1.3),
    ),
    Spec(
        "ScaledSwiGLU",
        lambda d, t: ops.ScaledSwiGLU(),
        lambda x, p, e: e[0].unsqueeze(-1) * F.silu(_halves(x)[0]) * _halves(x)[1],
        extra_shapes=((3, 4),),
    ),
    Spec(
        "ClampedSwiGLU_offset_interleaved",
        lambda d, t: ops.ClampedSwiGLU(
            limit=1.5, alpha=1.3, glu_linear_offset=0.25, glu_interleave_size=4
        ),
        lambda x, p, e: _clamped_swiglu(_deinterleave(x, 4), 1.5, 1.3, 0.25),
    ),
    Spec(
        "SwiGLU_interleaved",
        lambda d, t: ops.SwiGLU(glu_interleave_size=2),
        lambda x, p, e: F.silu(_halves(_deinterleave(x, 2))[0]) * _halves(_deinterleave(x, 2))[1],
    ),
    Spec("SiTUGLU", lambda d, t: ops.SiTUGLU(), lambda x, p, e: _situglu(x)),
    Spec(
        "SiTUGLU_small_betas_interleaved",
        lambda d, t: ops.SiTUGLU(beta1=0.7, beta2=1.2, glu_interleave_size=4),
        lambda x, p, e: _situglu(_deinterleave(x, 4), 0.7, 1.2),
    ),
    Spec(
        "ScaledSwiGLU_interleaved",
        lambda d, t: ops.ScaledSwiGLU(8),
        lambda x, p, e: e[0].unsqueeze(-1)
        * F.silu(_halves(_deinterleave(x, 8))[0])
        * _halves(_deinterleave(x, 8))[1],
        extra_shapes=((3, 4),),
    ),
    Spec(
        "ScaledSiTUGLU",
        lambda d, t: ops.ScaledSiTUGLU(beta1=0.9, beta2=1.5),
        lambda x, p, e: e[0].unsqueeze(-1) * _situglu(x, 0.9, 1.5),
        extra_shapes=((3, 4),),
    ),
    Spec(
        "ScaledClampedQGeGLU_interleaved",
        lambda d, t: ops.ScaledClampedQGeGLU(4, limit=1.5, alpha=1.702, glu_linear_offset=0.5),
        lambda x, p, e: e[0].unsqueeze(-1) * _clamped_swiglu(_deinterleave(x, 4), 1.5, 1.702, 0.5),
        extra_shapes=((3, 4),),
    ),
    Spec(
        "ScaledSReLU",
        lambda d, t: ops.ScaledSReLU(),
        lambda x, p, e: e[0].unsqueeze(-1) * _srelu(x),
        extra_shapes=((3, 4),),
    ),
    Spec(
        "ScaledTanhSReLU",
        lambda d, t: ops.ScaledTanhSReLU(tanh_clamp_scale=0.8),
        lambda x, p, e: e[0].unsqueeze(-1) * (0.8 * torch.tanh(F.relu(x) / 0.8)) ** 2,
        extra_shapes=((3, 4),),
    ),
    Spec(
        "AddExtraInput",
        lambda d, t: ops.AddExtraInput(),
        lambda x, p, e: x + e[0],
        extra_shapes=((3, 4, 16),),
        exact=True,
    ),
    Spec("MakeExtraOutput", lambda d, t: ops.MakeExtraOutput(), lambda x, p, e: (x, x), exact=True),
    Spec("DropoutEval", lambda d, t: ops.Dropout(0.3).eval(), lambda x, p, e: x, exact=True),
]

assert math  # keeps the import for users of this module

"""torch.library.opcheck for every torch.ops.fusible op, on CPU and (on a GPU machine) CUDA."""

import pytest
import torch
from conftest import DEVICES

F = torch.ops.fusible


def _cases(device):
    r = lambda *s, **kw: torch.randn(*s, device=device, **kw)  # noqa: E731
    x, w, b = r(6, 8), r(5, 8), r(5)
    lnw, lnb = r(8), r(8)
    y, mean, rstd = F.layernorm_fwd(x, lnw, lnb, 1e-5, False)
    _, rrstd = F.rmsnorm_fwd(x, lnw, 1e-5, True)
    _, l2rstd = F.l2norm_fwd(x, 1e-6)
    hw, hb, hdy = lnw.bfloat16(), lnb.bfloat16(), r(6, 8).bfloat16()
    _, hmean, hrstd = F.layernorm_fwd(x, hw, hb, 1e-5, False)
    _, hrrstd = F.rmsnorm_fwd(x, hw, 1e-5, True)
    _, mask = F.dropout_fwd(x, 0.3)
    dy8, dy5, dy4 = r(6, 8), r(6, 5), r(6, 4)
    return [
        (F.linear_fwd, (x, w, b)),
        (F.linear_fwd, (x, w, None)),
        (F.linear_dgrad, (dy5, w)),
        (F.linear_wgrad, (dy5, x)),
        (F.layernorm_fwd, (x, lnw, lnb, 1e-5, True)),
        (F.layernorm_bwd, (dy8, x, mean, rstd, lnw, False)),
        (F.rmsnorm_fwd, (x, lnw, 1e-5, False)),
        (F.rmsnorm_bwd, (dy8, x, rrstd, lnw, True)),
        (F.l2norm_fwd, (x, 1e-6)),
        (F.l2norm_bwd, (dy8, x, l2rstd)),
        *[(F.activation_fwd, (x, k)) for k in ("gelu", "qgelu", "relu", "srelu", "silu")],
        *[(F.activation_bwd, (dy8, x, k)) for k in ("gelu", "qgelu", "relu", "srelu", "silu")],
        *[(F.glu_fwd, (x, k)) for k in ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu")],
        *[
            (F.glu_bwd, (dy4, x, k))
            for k in ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu")
        ],
        (F.clamped_swiglu_fwd, (x, 1.0, 1.702)),
        (F.clamped_swiglu_bwd, (dy4, x, 1.0, 1.702)),
        (F.scaled_swiglu_fwd, (x, r(6))),
        (F.scaled_swiglu_bwd, (dy4, x, r(6))),
        (F.scaled_swiglu_bwd_fwd, (dy4, x, r(6))),
        (F.clamped_swiglu_fwd, (x, 1.0, 1.702, 0.5)),
        (F.clamped_swiglu_bwd, (dy4, x, 1.0, 1.702, 0.5)),
        (F.situglu_fwd, (x, 1.5, 2.0)),
        (F.situglu_bwd, (dy4, x, 1.5, 2.0)),
        (F.scaled_situglu_fwd, (x, r(6), 1.5, 2.0)),
        (F.scaled_situglu_bwd, (dy4, x, r(6), 1.5, 2.0)),
        (F.scaled_clamped_swiglu_fwd, (x, r(6), 1.0, 1.702, 0.5)),
        (F.scaled_clamped_swiglu_bwd, (dy4, x, r(6), 1.0, 1.702, 0.5)),
        (F.scale_fwd, (x, 0.5)),
        (F.add_fwd, (x, r(6, 8))),
        (F.add_, (r(6, 8), x)),
        (F.dropout_bwd, (dy8, mask, 0.3)),
        (F.bias_fwd, (x, lnb)),
        (F.bias_bwd, (dy8,)),
        *[(F.linear_bias_act_fwd, (x, w, bb, act)) for bb in (b, None) for act in ("gelu", "relu")],
        *[(F.linear_bias_act, (x, w, bb, a)) for bb in (b, None) for a in ("gelu", "relu")],
        (F.linear_add, (x, w, b, r(6, 5), 0.5)),
        (F.linear_add, (x, w, None, r(6, 5), 1.0)),
        (F.linear_add_, (r(6, 5), x, w, b, 2.0)),
        (F.linear_wgrad_add_, (r(5, 8), dy5, x)),
        (F.linear_wgrad_add_, (r(5, 8), dy5.bfloat16(), x.bfloat16(), 0.5, 0.0)),
        (F.linear_dgrad, (dy5, w, 0.25)),
        (F.linear_wgrad, (dy5, x, 0.25)),
        (F.linear_dgrad_add, (dy5, w, r(6, 8), 0.5)),
        *[(F.linear_dgrad_act_bias, (dy5, w, r(6, 8), act)) for act in ("gelu", "relu")],
        *[(F.bias_act_bwd, (dy8, r(6, 8), act)) for act in ("gelu", "relu")],
        *[(F.bias_act_bwd_, (r(6, 8), r(6, 8), act)) for act in ("gelu", "relu")],
        (F.rmsnorm_bwd_add, (dy8, x, rrstd, lnw, False, r(6, 8))),
        (F.layernorm_bwd_add, (dy8, x, mean, rstd, lnw, True, r(6, 8))),
        # A float32 x beside bf16 weights: y in bf16, dx (and dextra) in float32.
        (F.layernorm_fwd, (x, hw, hb, 1e-5, False)),
        (F.rmsnorm_fwd_amax, (x, hw, 1e-5, False)),
        (F.layernorm_bwd_add, (hdy, x, hmean, hrstd, hw, False, r(6, 8))),
        (F.rmsnorm_bwd, (hdy, x, hrrstd, hw, True)),
        *[(F.fp8_quantize_dequantize, (x, fmt, 1.0)) for fmt in ("e4m3", "e5m2")],
        *[
            (F.fp8_quantize_dequantize_delayed, (x, "e4m3", r(4).abs(), r(1).abs(), 0.0, algo))
            for algo in ("max", "most_recent")
        ],
        *[(F.fp8_quantize_dequantize_block, (r(6, 130), "e4m3", d, True)) for d in (1, 2)],
        *[
            (F.fp8_cast, (r(16, 32), fmt, 1.0, t))
            for fmt in ("e4m3", "e5m2")
            for t in (True, False)
        ],
        (F.fp8_cast_delayed, (r(16, 32), "e4m3", r(4).abs(), r(1).abs(), 0.0, "max", True)),
        *[
            (F.fp8_cast_with_amax, (r(16, 32), "e4m3", r(1).abs() * 3, 0.0, t))
            for t in (True, False)
        ],
        (F.fp8_amax, (r(16, 32),)),
        *[
            (F.fp8_cast_grouped, (r(48, 32).to(dt), [16, 0, 32], "e4m3", 0.0, t))
            for dt in (torch.float32, torch.bfloat16)
            for t in (True, False)
        ],
        (F.layernorm_fwd_amax, (x, lnw, lnb, 1e-5, False)),
        (F.rmsnorm_fwd_amax, (x, lnw, 1e-5, True)),
        *[(F.bias_act_bwd_amax, (dy8, r(6, 8), act)) for act in ("gelu", "relu")],
        *[(F.bias_act_bwd_amax_, (r(6, 8), r(6, 8), act)) for act in ("gelu", "relu")],
        # Whole 128x128 tiles in bf16 (the CUDA kernel), and a ragged fp32 shape (ATen).
        *[
            (F.fp8_cast_block, (r(256, 128).to(torch.bfloat16), "e4m3", d, True, True))
            for d in (1, 2)
        ],
        (F.fp8_cast_block, (r(130, 200), "e5m2", 1, False, True)),
        *_grouped_cases(device, r),
        *_rotary_cases(r),
        *_cross_entropy_cases(device, r),
    ]


def _cross_entropy_cases(device, r):
    logits, targets = r(6, 16), torch.tensor([0, 15, -100, 3, 3, 7], device=device)
    _, stats = F.cross_entropy_fwd(logits, targets)
    return [
        (F.cross_entropy_fwd, (logits, targets)),
        (F.cross_entropy_fwd, (logits.to(torch.bfloat16), targets.clamp(min=3), 3)),
        (F.cross_entropy_bwd, (r(6), logits, targets, stats)),
    ]


def _rotary_cases(r):
    cos, sin = r(7, 4), r(7, 4)
    grads = [r(2, 3, 5, 8).transpose(1, 2) for _ in range(3)]  # SDPA-like strides
    return [
        (F.qkv_rotary_fwd, (r(2, 5, 3 * 3 * 8), cos, sin, 3)),
        (F.qkv_rotary_bwd, (*grads, cos, sin)),
    ]


def _grouped_cases(device, r):
    split = torch.tensor([2, 0, 4], device=device)
    x, w, b, s, dy = r(6, 8), r(3, 5, 8), r(3, 5), r(6), r(6, 5)
    return [
        (F.grouped_linear_fwd, (x, w, split, b, s)),
        (F.grouped_linear_fwd, (x, w, split.int(), b, None)),
        (F.grouped_linear_fwd, (x, w, split, None, None)),
        (F.grouped_linear_dgrad, (dy, w, split)),
        (F.grouped_linear_wgrad, (dy, x, split.int())),
        (F.grouped_bias_bwd, (dy, split, s, b)),
        (F.grouped_bias_bwd, (dy, split, None, None)),
    ]


def _fp8_gemm_cases(device, r):
    a, sa = F.fp8_cast(r(2, 16, 32), "e4m3")[::2]
    b, sb = F.fp8_cast(r(48, 32), "e4m3")[::2]
    g, sg = F.fp8_cast(r(48, 32), "e5m2")[::2]
    bf = torch.bfloat16
    bias = r(48).to(bf)
    return [
        (F.fp8_gemm, (a, sa, b, sb, bf)),
        (F.fp8_gemm, (a, sa, g, sg, torch.float32, None, None, 0.5)),
        (F.fp8_gemm, (a, sa, b, sb, bf, bias, r(2, 16, 48).to(bf), 1.0, "none", False, True)),
        *[(F.fp8_gemm, (a, sa, b, sb, bf, bias, None, 1.0, act, True)) for act in ("gelu", "relu")],
        (F.fp8_gemm_out, (a, sa, b, sb, r(2, 16, 48).to(bf))),
        (F.fp8_gemm_out, (a, sa, g, sg, r(2, 16, 48), None, 0.5)),
        (F.fp8_gemm_out, (a, sa, b, sb, r(2, 16, 48).to(bf), bias, 1.0, True)),
        (F.fp8_gemm_out, (a, sa, b, sb, r(2, 16, 48), None, 0.5, False, 0, 0, True)),
        # Block scales: 1x128 rows of a, 128x128 tiles of b.
        (
            F.fp8_gemm,
            (*F.fp8_cast_block(r(128, 128).to(bf), "e4m3", 1)[:2],)
            + (*F.fp8_cast_block(r(256, 128).to(bf), "e4m3", 2)[:2],)
            + (bf, None, None, 1.0, "none", False, False, 1, 2),
        ),
    ]


class TestOpcheck:
    @pytest.mark.parametrize("device", DEVICES)
    def test_every_deterministic_op(self, device):
        for op, args in _cases(device):
            torch.library.opcheck(op.default, args)

    @pytest.mark.parametrize("device", DEVICES)
    def test_fp8_gemm(self, device):
        # FP8 inputs: the schema test compares inputs with torch.allclose, which has no FP8
        # kernels; the other checks run.
        r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
        for op, args in _fp8_gemm_cases(device, r):
            torch.library.opcheck(
                op.default,
                args,
                test_utils=(
                    "test_autograd_registration",
                    "test_faketensor",
                    "test_aot_dispatch_dynamic",
                ),
            )

    @pytest.mark.parametrize("device", DEVICES)
    def test_dropout_fwd(self, device):
        # Random: eager and traced runs draw different masks, so the output-comparing aot test is
        # left out; schema, autograd registration and fake-tensor checks still run.
        x = torch.randn(6, 8, device=device)
        torch.library.opcheck(
            torch.ops.fusible.dropout_fwd.default,
            (x, 0.3),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )

    def test_every_registered_op_is_checked(self):
        registered = {
            n.split("::")[1]
            for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("fusible::")
        }
        checked = {op._qualified_op_name.split("::")[1] for op, _ in _cases("cpu")}
        checked |= {"dropout_fwd", "fp8_gemm", "fp8_gemm_out"}
        # The compiled Sequential's call ops: opcheck in test_compile_fullgraph.py.
        checked |= {"sequential_call", "sequential_call_backward"}
        assert "bias_fwd" in registered and "linear_fwd" in registered
        assert registered == checked, registered ^ checked


@pytest.mark.parametrize("device", DEVICES)
def test_ops_ignore_torch_autocast(device):
    """The ops compute in the dtypes they are given: torch.autocast casts neither their inputs nor
    the ATen calls inside the CPU references (those once returned bf16 under CPU autocast)."""
    torch.manual_seed(0)
    for op, args in _cases(device):
        want = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        with torch.autocast(device, dtype=torch.bfloat16):
            got = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        for w, g in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (want, got))):
            if isinstance(w, torch.Tensor):
                assert g.dtype == w.dtype, op
                torch.testing.assert_close(g, w, msg=str(op))

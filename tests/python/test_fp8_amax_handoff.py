"""FP8 current scaling's amax handoff: the kernel that writes a tensor (LayerNorm / RMSNorm forward,
the bias + activation backward) also computes max |tensor|, and the next linear's cast takes it
(fp8_cast_with_amax) instead of reading the tensor once more. The bytes must be the ones the cast's
own amax pass gives, forward, backward and after optimizer steps."""

import fusible
import pytest
import torch
from conftest import DEVICES, FP8_GEMM_DEVICES
from fusible import ops, recipe

F = torch.ops.fusible


def _bytes(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _assert_same_cast(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bytes(g), _bytes(w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transpose", [False, True])
def test_cast_with_amax_equals_cast(device, dtype, transpose):
    torch.manual_seed(0)
    x = (torch.randn(64, 48, device=device) * 3).to(dtype)
    amax = x.float().abs().amax().reshape(1)
    for fmt, margin in (("e4m3", 0.0), ("e5m2", 1.0)):
        want = F.fp8_cast(x, fmt, margin, transpose)
        _assert_same_cast(F.fp8_cast_with_amax(x, fmt, amax, margin, transpose), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0])
def test_cast_with_amax_nonfinite_or_zero_amax_means_scale_one(device, bad):
    # A NaN or infinite amax handed in (the producers leave NaN elements out, but an infinity
    # counts), and an all-zero tensor, cast with scale 1 as fp8_cast does.
    x = torch.randn(32, 16, device=device).to(torch.bfloat16)
    data, data_t, scale_inv = F.fp8_cast_with_amax(
        x, "e4m3", torch.tensor([bad], device=device), 0.0, True
    )
    assert scale_inv.item() == 1.0
    want = F.fp8_cast_with_amax(x, "e4m3", torch.ones(1, device=device) * 448, 0.0, True)
    _assert_same_cast((data, data_t), want[:2])


def test_cast_with_amax_bad_amax():
    x = torch.randn(16, 16)
    with pytest.raises(ValueError, match="fp8_cast_with_amax: expected amax to be a float32"):
        F.fp8_cast_with_amax(x, "e4m3", torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"of shape \[1\], got .* of shape \[2\]"):
        F.fp8_cast_with_amax(x, "e4m3", torch.ones(2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_forwards_report_their_output_amax(device, dtype):
    torch.manual_seed(1)
    # 300 rows: many blocks of the CUDA kernel, each reporting its own part of the max.
    x = (torch.randn(300, 256, device=device) * 2).to(dtype)
    w, b = (torch.randn(256, device=device).to(dtype) for _ in range(2))
    y, mean, rstd = F.layernorm_fwd(x, w, b, 1e-5, False)
    ya, ma, ra, amax = F.layernorm_fwd_amax(x, w, b, 1e-5, False)
    for g, want in ((ya, y), (ma, mean), (ra, rstd)):
        assert torch.equal(g, want)
    assert amax.dtype == torch.float32 and amax.shape == (1,)
    assert amax.item() == y.float().abs().max().item()
    y, rstd = F.rmsnorm_fwd(x, w, 1e-5, True)
    ya, ra, amax = F.rmsnorm_fwd_amax(x, w, 1e-5, True)
    assert torch.equal(ya, y) and torch.equal(ra, rstd)
    assert amax.item() == y.float().abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_bias_act_backward_reports_its_output_amax(device, act):
    torch.manual_seed(2)
    dy = torch.randn(520, 384, device=device).to(torch.bfloat16)
    pre = torch.randn(520, 384, device=device).to(torch.bfloat16)
    dpre, dbias = F.bias_act_bwd(dy, pre, act)
    dpre_a, dbias_a, amax = F.bias_act_bwd_amax(dy, pre, act)
    assert torch.equal(dpre_a, dpre) and torch.equal(dbias_a, dbias)
    assert amax.item() == dpre.float().abs().max().item()
    dy_in_place = dy.clone()
    dbias_b, amax_b = F.bias_act_bwd_amax_(dy_in_place, pre, act)
    assert torch.equal(dy_in_place, dpre) and torch.equal(dbias_b, dbias)
    assert torch.equal(amax_b, amax)


def _mlp(norm, device, hidden=64, ffn=128):
    dt = torch.bfloat16
    seq = ops.Sequential(
        norm(hidden, device=device, dtype=dt),
        ops.Linear(hidden, ffn, device=device, dtype=dt),
        ops.GELU(),
        ops.Linear(ffn, hidden, device=device, dtype=dt),
    )
    with torch.no_grad():  # every parameter random: a zero bias hides a wrong bias path
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return seq


def _train(seq, x, dy, steps, handoff):
    """Outputs, input gradients and parameters after `steps` SGD steps under FP8 current scaling,
    with the producers' amaxes handed to the casts or not; and how often each kernel op ran."""
    fusible._C._set_fp8_amax_handoff(handoff)
    opt = torch.optim.SGD(seq.parameters(), lr=0.05)
    outs = []
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                opt.zero_grad()
                xg = x.clone().requires_grad_()
                with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
                    y = seq(xg)
                y.backward(dy)
                opt.step()
                outs += [y.detach(), xg.grad]
    finally:
        fusible._C._set_fp8_amax_handoff(True)
    counts = {}
    for e in prof.events():
        if e.name.startswith("fusible::"):
            counts[e.name] = counts.get(e.name, 0) + 1
    return outs + [p.detach().clone() for p in seq.parameters()], counts


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
@pytest.mark.parametrize("norm", [ops.LayerNorm, ops.RMSNorm])
def test_handoff_gives_the_same_training_run(device, norm):
    torch.manual_seed(3)
    x = torch.randn(2, 16, 64, device=device).to(torch.bfloat16)
    dy = torch.randn(2, 16, 64, device=device).to(torch.bfloat16)
    runs = {}
    for handoff in (True, False):
        torch.manual_seed(4)
        runs[handoff] = _train(_mlp(norm, device), x, dy, steps=3, handoff=handoff)
    (with_, counts_on), (without, counts_off) = runs[True], runs[False]
    for a, b in zip(with_, without):
        assert torch.equal(a, b)
    # With the handoff: the norm's forward and the GELU + bias backward report their amaxes, and
    # fc1's input and gradient casts take them (once per step each). Without: none of that.
    norm_amax = f"fusible::{'layernorm' if norm is ops.LayerNorm else 'rmsnorm'}_fwd_amax"
    assert counts_on.get(norm_amax) == 3
    # (fc2's dgrad and the GELU + bias backward are one fused op: the in-place kernel)
    assert counts_on.get("fusible::bias_act_bwd_amax_") == 3
    assert counts_on.get("fusible::fp8_cast_with_amax") == 6
    assert not any("_amax" in k for k in counts_off), counts_off
    # The casts that took an amax are the ones that no longer run fp8_cast.
    assert counts_off["fusible::fp8_cast"] - counts_on["fusible::fp8_cast"] == 6


def test_handoff_is_not_used_without_current_scaling():
    torch.manual_seed(5)
    seq = _mlp(ops.LayerNorm, "cpu")
    x = torch.randn(32, 64).to(torch.bfloat16).requires_grad_()
    for r in (recipe.DelayedScaling(), recipe.Float8BlockScaling()):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with fusible.autocast(recipe=r):
                y = seq(x)
            y.sum().backward()
        names = {e.name for e in prof.events()}
        assert not any("_amax" in n for n in names if n.startswith("fusible::")), names

"""A deferred activation under FP8 delayed scaling: an activation whose next op is a linear hands
over act(pre) without computing it, and the linear's one-pass FP8 cast applies the activation on
the way in (the casts' act=..., which fp8_cast and fp8_cast_block take too). The casts must write
the bytes of a cast of activation_fwd's output, and a model must train as it does without the
handoff. Current and block scaling do not defer (their casts would pay more for the activation
than its own kernel costs)."""

import copy
import re

import fusible
import pytest
import torch
from conftest import DEVICES, FP8_GEMM_DEVICES
from fusible import ops, recipe

F = torch.ops.fusible
ACTS = ["gelu", "qgelu", "relu", "srelu", "silu"]
RECIPES = {
    "current": recipe.Float8CurrentScaling,
    "delayed": recipe.DelayedScaling,
    "block": recipe.Float8BlockScaling,
}


def _bytes(t):
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(_bytes(g), _bytes(w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_casts_with_act_write_the_cast_of_the_activation(device, act, dtype):
    if dtype == torch.float32 and device == "cuda":
        pytest.skip("fp32 takes the ATen cast on CUDA, whose bytes the kernel's need not match")
    torch.manual_seed(0)
    # Ragged rows and columns: partial tiles and blocks.
    x = (torch.randn(200, 136, device=device) * 3).to(dtype)
    y = F.activation_fwd(x, act)
    for fmt, margin in (("e4m3", 0.0), ("e5m2", 1.0)):
        for transpose in (False, True):
            _assert_same(
                F.fp8_cast(x, fmt, margin, transpose, act), F.fp8_cast(y, fmt, margin, transpose)
            )
    # Delayed scaling: the same bytes, and the same history and scale afterwards.
    history = torch.rand(16, device=device) * 5
    states = [(history.clone(), torch.full((1,), 2.0, device=device)) for _ in range(2)]
    got = F.fp8_cast_delayed(x, "e4m3", *states[0], 0.0, "max", True, act)
    want = F.fp8_cast_delayed(y, "e4m3", *states[1], 0.0, "max", True)
    _assert_same(got, want)
    _assert_same(states[0], states[1])
    if dtype != torch.float32:
        for block_dim in (1, 2):
            _assert_same(
                F.fp8_cast_block(x, "e4m3", block_dim, True, True, act),
                F.fp8_cast_block(y, "e4m3", block_dim, True, True),
            )


@pytest.mark.parametrize("device", DEVICES)
def test_casts_refuse_an_unknown_act(device):
    x = torch.randn(16, 32, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp8_cast: expected kind in .* got 'geglu'"):
        F.fp8_cast(x, "e4m3", 0.0, False, "geglu")
    with pytest.raises(ValueError, match="fp8_cast_block: expected kind in .* got 'tanh'"):
        F.fp8_cast_block(x, "e4m3", 1, True, False, "tanh")
    history, scale = torch.zeros(4, device=device), torch.ones(1, device=device)
    with pytest.raises(ValueError, match="fp8_cast_delayed: expected kind in"):
        F.fp8_cast_delayed(x, "e4m3", history, scale, 0.0, "max", False, "x")


def _mlp(device, bias, split):
    """fc1 -> GELU -> fc2 with random parameters; `split`: Identity ops around the GELU (the GELU
    then runs on its own, in no GEMM epilogue, and nothing is deferred): the same arithmetic."""
    dt = torch.bfloat16
    gelu = [ops.Identity(), ops.GELU(), ops.Identity()] if split else [ops.GELU()]
    layers = [ops.Linear(64, 128, bias=bias, device=device, dtype=dt), *gelu]
    layers += [ops.Linear(128, 64, device=device, dtype=dt)]
    seq = ops.Sequential(*layers)
    with torch.no_grad():  # every parameter random: a zero bias hides a wrong bias path
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return seq


def _train(seq, x, dy, fp8_recipe, steps=3):
    """Outputs, input gradients and parameters after `steps` SGD steps under the recipe; the names
    of the ops and kernels that ran."""
    opt = torch.optim.SGD(seq.parameters(), lr=0.05)
    outs = []
    activities = [torch.profiler.ProfilerActivity.CPU]
    if x.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            opt.zero_grad()
            xg = x.clone().requires_grad_()
            with fusible.autocast(recipe=fp8_recipe):
                y = seq(xg)
            y.backward(dy)
            opt.step()
            outs += [y.detach(), xg.grad]
    names = [e.name for e in prof.events()]
    return outs + [p.detach().clone() for p in seq.parameters()], names


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
@pytest.mark.parametrize("kind", list(RECIPES))
@pytest.mark.parametrize("bias", [True, False])
def test_deferred_activation_trains_as_without(device, kind, bias):
    deferring = kind == "delayed"
    torch.manual_seed(3)
    x = torch.randn(2, 64, 64, device=device).to(torch.bfloat16)
    dy = torch.randn(2, 64, 64, device=device).to(torch.bfloat16)
    runs = {}
    for split in (False, True):
        torch.manual_seed(4)
        runs[split] = _train(_mlp(device, bias, split), x, dy, RECIPES[kind]())
    (deferred, names), (plain, plain_names) = runs[False], runs[True]
    # Deferred under delayed scaling: the lone GELU's output (no bias), or the output of fc1's GEMM
    # op, which runs on FP8 data here (on CPU too: the ATen FP8 GEMM). A stand-in per step (one
    # NaN, broadcast); none under the other recipes.
    assert names.count("aten::full") - plain_names.count("aten::full") == (3 if deferring else 0)
    if not deferring:
        for a, b in zip(deferred, plain, strict=True):
            assert torch.isfinite(a).all() and _rel(a, b) < 0.1
        return
    # The cast of act(pre) from pre writes the bytes of the cast of activation_fwd(pre). Without a
    # bias: the same training run bit for bit (outputs, input gradients, parameters after the
    # steps). With one, the split run's backward is not fused (its bias gradient is summed from the
    # rounded dpre): the first step's output and input gradient are the same bits.
    compared = deferred if not bias else deferred[:2]
    for a, b in zip(compared, plain, strict=False):
        assert torch.equal(a, b)
    for a, b in zip(deferred, plain, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, b) < 0.1
    kernels = [n for n in names if "kernel" in n or "nvjet" in n]
    if device == "cuda" and kernels:  # (none under compute-sanitizer: no CUDA profiling there)
        # The cast kernels with the activation on load ran: their template's last flag.
        on_load = re.compile(
            r"(cast_transpose|cast_transpose_one_launch|cast_block|amax)_kernel<[^>]*, true>"
        )
        assert any(on_load.search(n) for n in names), sorted(set(names))
        assert not any(on_load.search(n) for n in plain_names)
        assert not any("geluaux" in n for n in names)


def test_an_op_that_does_not_take_it_gets_the_activation():
    # A Python op after the activation: nothing is deferred to it (it would read the stand-in).
    seen = {}

    class Record(ops.BasicOperation):
        def op_forward(self, ctx, input_, **unused):
            seen["x"] = input_.detach().clone()
            return input_

        def op_backward(self, ctx, grad_output):
            return grad_output, []

    torch.manual_seed(5)
    dt = torch.bfloat16
    fc1 = ops.Linear(64, 128, device="cpu", dtype=dt)
    seq = ops.Sequential(fc1, ops.GELU(), Record(), ops.Linear(128, 64, device="cpu", dtype=dt))
    with torch.no_grad():  # every parameter random
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(32, 64).to(torch.bfloat16)
    # Delayed scaling: the recipe under which a GELU before a linear would be deferred.
    with fusible.autocast(recipe=recipe.DelayedScaling()):
        seq(x)
    assert torch.isfinite(seen["x"]).all()

    def first_cast(t):  # a fresh delayed state casts with scale 1
        return F.fp8_quantize_dequantize_delayed(
            t, "e4m3", torch.zeros(4), torch.ones(1), 0.0, "max"
        )

    want = torch.nn.functional.gelu(
        torch.nn.functional.linear(
            first_cast(x).double(), first_cast(fc1.weight).double(), fc1.bias.double()
        ),
        approximate="tanh",
    )
    assert _rel(seen["x"], want) < 1e-2


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_no_grad_forward_with_a_deferred_activation(device):
    torch.manual_seed(6)
    seq = _mlp(device, bias=False, split=False)
    x = torch.randn(64, 64, device=device).to(torch.bfloat16)
    twin = copy.deepcopy(seq)  # the same parameters and delayed-scaling state
    split = ops.Sequential(twin[0], twin[1], ops.Identity(), twin[2])
    outs = []
    for model in (seq, split, seq, split):  # twice: the second with the updated scales
        with torch.no_grad(), fusible.autocast(recipe=recipe.DelayedScaling()):
            outs.append(model(x))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])

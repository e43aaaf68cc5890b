"""GroupedLinear and the fused MoE expert MLP under FP8 (te.ops' per-group quantizers: group g's
input, weight and gradient each cast by its own), against one Linear per group and against the
unfused plan over several optimizer steps, with delayed-scaling histories compared too; FP8
weights per group from quantized_model_init, block-scaled ones included."""

import copy

import fusible
import pytest
import torch
from conftest import DEVICES
from fusible import ops, recipe
from fusible._float8_tensor import Float8Tensor
from test_fp8 import qdq, qdq_blocks
from test_grouped_linear import _expert_mlp

D = torch.float64
RECIPES = {
    "current": recipe.Float8CurrentScaling,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "block": recipe.Float8BlockScaling,
}


def randomized(module, scale=0.3):
    with torch.no_grad():
        for p in module.parameters():  # every parameter random and nonzero, biases included
            p.copy_(torch.randn_like(p) * scale + 0.01)
    return module


def sgd(params, lr=0.05):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None


def quantizer(op, mode, index):
    q = op.get_quantizer(mode, index)
    return q.amax_history.clone(), q.scale.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_each_group_casts_as_its_own_linear(device, kind):
    torch.manual_seed(1)
    G, sizes = 3, [5, 3, 8]
    grouped = randomized(ops.GroupedLinear(G, 32, 16, device=device, dtype=D))
    linears = [ops.Linear(32, 16, device=device, dtype=D) for _ in range(G)]
    with torch.no_grad():
        for g, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{g}"))
            lin.bias.copy_(getattr(grouped, f"bias{g}"))
    rec = RECIPES[kind]()
    split = torch.tensor(sizes, device=device)
    for _ in range(3):
        x = torch.randn(16, 32, device=device, dtype=D)
        dy = torch.randn(16, 16, device=device, dtype=D)
        xg = x.clone().requires_grad_()
        xl = [p.clone().requires_grad_() for p in x.split(sizes)]
        with fusible.autocast(recipe=rec):
            y = grouped(xg, split)
            yl = [lin(p) for lin, p in zip(linears, xl)]
        y.backward(dy)
        for lin_y, part in zip(yl, dy.split(sizes)):
            lin_y.backward(part)
        torch.testing.assert_close(y, torch.cat(yl), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(xg.grad, torch.cat([p.grad for p in xl]), rtol=1e-12, atol=1e-12)
        for g, lin in enumerate(linears):
            for name, p in (("weight", lin.weight), ("bias", lin.bias)):
                got = getattr(grouped, f"{name}{g}").grad
                torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)
        if kind == "current":  # and against the float64 cast itself
            w0 = grouped.weight0.detach()
            want = qdq(x[:5], "e4m3") @ qdq(w0, "e4m3").T + grouped.bias0.detach()
            torch.testing.assert_close(y[:5], want, rtol=1e-12, atol=1e-12)
        sgd(grouped.parameters())
        for lin in linears:
            sgd(lin.parameters())
    if kind == "delayed":  # quantizers: x of group g, then W of group g; gradient of group g
        for g, lin in enumerate(linears):
            pairs = [("forward", g, 0), ("forward", G + g, 1), ("backward", g, 0)]
            for mode, i, j in pairs:
                for a, b in zip(quantizer(grouped, mode, i), quantizer(lin.basic_ops[0], mode, j)):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grouped.num_quantizers("forward") == 2 * G
    assert grouped.num_quantizers("backward") == G


def test_an_empty_group_and_the_fp8_casts_against_float64():
    torch.manual_seed(2)
    op = randomized(ops.GroupedLinear(3, 16, 8, device="cpu", dtype=D))
    x = torch.randn(12, 16, dtype=D, requires_grad=True)
    dy = torch.randn(12, 8, dtype=D)
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        y = op(x, torch.tensor([5, 0, 7]))
    y.backward(dy)
    for g, rows in ((0, slice(0, 5)), (2, slice(5, 12))):
        w, b = getattr(op, f"weight{g}").detach(), getattr(op, f"bias{g}").detach()
        xq, wq, dyq = qdq(x.detach()[rows], "e4m3"), qdq(w, "e4m3"), qdq(dy[rows], "e5m2")
        torch.testing.assert_close(y[rows], xq @ wq.T + b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad[rows], dyq @ wq, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(getattr(op, f"weight{g}").grad, dyq.T @ xq)
        torch.testing.assert_close(getattr(op, f"bias{g}").grad, dy[rows].sum(0))
    assert not op.weight1.grad.any()
    # Split sizes given as a strided view are read in order.
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        strided = op(x.detach(), torch.tensor([5, 9, 0, 9, 7, 1])[::2])
    torch.testing.assert_close(strided, y.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="summing to the input's 12 rows, got 11"):
        with fusible.autocast():
            op(x, torch.tensor([5, 0, 6]))


def _step(seq, x, dy, rec, fused):
    snapshot = ops.snapshot_fusions()
    if not fused:
        ops.restore_fusions(([], {}))  # no fusions: the unfused plan
    try:
        x = x.detach().clone().requires_grad_()
        with fusible.autocast(recipe=rec):
            y = seq(x)
        y.backward(dy)
        plan = seq.fusion_plan()[0]["forward"]
    finally:
        ops.restore_fusions(snapshot)
    assert ("GroupedMLP_GroupedGEMMGLU" in plan) == fused, plan
    out = [y.detach(), x.grad] + [p.grad.clone() for p in seq.parameters()]
    sgd(seq.parameters())
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_fused_expert_mlp_under_fp8_equals_its_unfused_plan(device, kind):
    fused = _expert_mlp(device, D, bias=True)
    unfused = copy.deepcopy(fused)
    rec = RECIPES[kind]()
    for _ in range(3):
        x = torch.randn(10, 16, device=device, dtype=D)
        dy = torch.randn(10, 8, device=device, dtype=D)
        for a, b in zip(_step(fused, x, dy, rec, True), _step(unfused, x, dy, rec, False)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for i in (1, 3):  # both GroupedLinears' quantizer states
        op_f, op_u = fused[i], unfused[i]
        if kind != "delayed":
            continue
        for mode in ("forward", "backward"):
            for j in range(op_f.num_quantizers(mode)):
                for a, b in zip(quantizer(op_f, mode, j), quantizer(op_u, mode, j)):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_block_scaled_fp8_weights_per_group(device):
    r, dt = recipe.Float8BlockScaling(), torch.bfloat16
    torch.manual_seed(3)
    with fusible.quantized_model_init(recipe=r):
        seq = _expert_mlp(device, dt, bias=True)
    fc1, fc2 = seq[1], seq[3]
    for op in (fc1, fc2):
        for g in range(3):
            w = getattr(op, f"weight{g}")
            assert isinstance(w, Float8Tensor) and w._block_dim == 2
            wd = w.dequantize().double().cpu()
            torch.testing.assert_close(qdq_blocks(wd, "e4m3", 2), wd, rtol=0, atol=0)
    # The same model with the dequantized weights in high precision computes the same: the FP8
    # weights are read as stored (a recast of grid values changes nothing).
    plain = copy.deepcopy(seq)
    for op in (plain[1], plain[3]):
        for g in range(3):
            name = f"weight{g}"
            setattr(op, name, torch.nn.Parameter(getattr(op, name).dequantize()))
    x = torch.randn(10, 16, device=device, dtype=dt)
    dy = torch.randn(10, 8, device=device, dtype=dt)
    got = _step(seq, x, dy, r, True)
    want = _step(plain, x, dy, r, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)
    # That step wrote each FP8 weight per 128x128 tile.
    for op, ref in ((fc1, plain[1]), (fc2, plain[3])):
        for g in range(3):
            w, w_ref = getattr(op, f"weight{g}"), getattr(ref, f"weight{g}")
            assert isinstance(w, Float8Tensor)
            want_w = qdq_blocks(w_ref.detach().double().cpu(), "e4m3", 2)
            torch.testing.assert_close(w.dequantize().double().cpu(), want_w, rtol=0, atol=0)


def test_a_single_grouped_weight_under_quantized_model_init_is_refused():
    with pytest.raises(NotImplementedError, match="single_grouped_weight=True"):
        with fusible.quantized_model_init():
            ops.GroupedLinear(2, 16, 16, single_grouped_weight=True, device="cpu")

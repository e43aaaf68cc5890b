"""GroupedLinear and the fused MoE expert MLP under FP8 (te.ops' per-group quantizers: group g's
input, weight and gradient each cast by its own), against one Linear per group and against the
unfused plan over several optimizer steps, with delayed-scaling histories compared too; FP8
weights per group from quantized_model_init, block-scaled ones included."""

import copy

import fusible
import pytest
import torch
from conftest import DEVICES, FP8_GEMM_DEVICES, randomized
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
    if kind == "delayed":  # te.ops' numbering: 2g is group g's x, 2g + 1 its W; gradient g
        for g, lin in enumerate(linears):
            pairs = [("forward", 2 * g, 0), ("forward", 2 * g + 1, 1), ("backward", g, 0)]
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


def test_an_expert_whose_rows_are_zeros_keeps_its_delayed_history():
    # te rolls a history only for a non-zero amax: an expert whose rows (and their gradient) are
    # all zeros this step keeps its input and gradient histories and scales; the others take
    # one entry each.
    from fusible import _C

    torch.manual_seed(6)
    op = randomized(ops.GroupedLinear(3, 16, 8, device="cpu", dtype=D))
    rec = recipe.DelayedScaling(amax_history_len=4)
    sizes = torch.tensor([4, 4, 4])
    for step in range(2):
        x, dy = torch.randn(12, 16, dtype=D), torch.randn(12, 8, dtype=D)
        if step:
            x[4:8], dy[4:8] = 0, 0
        with fusible.autocast(recipe=rec):
            y = op(x, sizes)
        y.backward(dy)
        if not step:
            state = _C._fp8_state(op._cpp)
            before = {
                d: [t.clone() for h, sc in state[d] for t in (h, sc)]
                for d in ("forward", "backward")
            }
    state = _C._fp8_state(op._cpp)
    for d, n in (("forward", 3), ("backward", 3)):
        histories = [h for h, _ in state[d][:n]]
        assert torch.equal(histories[1], before[d][2]), d  # expert 1: as after the first step
        assert torch.equal(state[d][1][1], before[d][3]), d
        for g in (0, 2):
            assert torch.equal(histories[g][1:], before[d][2 * g][:-1]), (d, g)  # rolled once
            assert histories[g][0] > 0


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


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_fp8_weights_per_group_on_fp8_gemms_under_current_scaling(device):
    """quantized_model_init weights (Float8Tensor) with FP8 GEMMs per group: each weight hands its
    stored data to its own cast, while x and dy take one grouped cast; the numbers equal those of
    the dequantized weights in high precision, over optimizer steps."""
    r, dt = recipe.Float8CurrentScaling(), torch.bfloat16
    torch.manual_seed(9)
    with fusible.quantized_model_init(recipe=r):
        op = ops.GroupedLinear(2, 64, 32, bias=False, device=device, dtype=dt)
    assert isinstance(op.weight0, Float8Tensor)
    plain = copy.deepcopy(op)
    for g in range(2):
        name = f"weight{g}"
        setattr(plain, name, torch.nn.Parameter(getattr(op, name).dequantize()))
    split = torch.tensor([16, 32], device=device)
    for step in range(3):
        x = torch.randn(48, 64, device=device).to(dt)
        dy = torch.randn(48, 32, device=device).to(dt)
        outs = []
        for module in (op, plain):
            xg = x.clone().requires_grad_()

            def run(module=module, xg=xg):
                with fusible.autocast(recipe=r):
                    outs.append(module(xg, split))
                outs[-1].backward(dy)

            names = _kernel_ops(run)
            assert "fusible::fp8_cast_grouped" in names and "fusible::fp8_gemm" in names, names
            if module is op:  # the FP8 weights' own casts (which take their stored data)
                assert "fusible::fp8_cast" in names, names
            outs.append(xg.grad)
        torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=0)
        torch.testing.assert_close(outs[1], outs[3], rtol=0, atol=0)
        for g in range(2):
            w, w_plain = getattr(op, f"weight{g}"), getattr(plain, f"weight{g}")
            torch.testing.assert_close(w.grad, w_plain.grad, rtol=0, atol=0)
        sgd(op.parameters())
        sgd(plain.parameters())
        for g in range(2):  # the FP8 weight requantized; the plain one as that step left it
            w, w_plain = getattr(op, f"weight{g}"), getattr(plain, f"weight{g}")
            with torch.no_grad():
                w_plain.copy_(w.dequantize())


def test_a_single_grouped_weight_under_quantized_model_init_is_refused():
    with pytest.raises(NotImplementedError, match="single_grouped_weight=True"):
        with fusible.quantized_model_init():
            ops.GroupedLinear(2, 16, 16, single_grouped_weight=True, device="cpu")


def _kernel_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("fusible::")}


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
@pytest.mark.parametrize("kind", ["current", "delayed"])
@pytest.mark.parametrize("single", [False, True])
def test_fp8_gemms_per_group_equal_one_linear_per_group(device, kind, single):
    """bf16 with every group's rows a multiple of 16: one FP8 GEMM per group on FP8 data (not the
    emulated casts and a grouped GEMM in bf16), the same numbers as one Linear per group, over
    optimizer steps; an empty group gets a zero weight gradient."""
    torch.manual_seed(7)
    G, sizes, dt = 3, [32, 0, 48], torch.bfloat16
    grouped = randomized(
        ops.GroupedLinear(G, 64, 32, device=device, dtype=dt, single_grouped_weight=single)
    )
    weights = [grouped.weight[g] if single else getattr(grouped, f"weight{g}") for g in range(G)]
    linears = [ops.Linear(64, 32, device=device, dtype=dt) for _ in range(G)]
    with torch.no_grad():
        for g, lin in enumerate(linears):
            lin.weight.copy_(weights[g])
            lin.bias.copy_(getattr(grouped, f"bias{g}"))
    rec = RECIPES[kind]()
    split = torch.tensor(sizes, device=device)
    for step in range(3):
        x = torch.randn(80, 64, device=device).to(dt)
        dy = torch.randn(80, 32, device=device).to(dt)
        xg = x.clone().requires_grad_()
        xl = [p.clone().requires_grad_() for p in x.split(sizes)]

        out = {}

        def run_grouped():
            with fusible.autocast(recipe=rec):
                out["y"] = grouped(xg, split)
            out["y"].backward(dy)

        if step == 0:  # profiled: which kernels ran (the numbers are compared as every step's)
            names = _kernel_ops(run_grouped)
            assert "fusible::fp8_gemm" in names and "fusible::grouped_linear_fwd" not in names
            assert "fusible::grouped_linear_wgrad" not in names, names
            # Each group's GEMM writes its rows of y and dx: no concatenation after them.
            assert "fusible::fp8_gemm_out" in names, names
            if kind == "current":  # x, W and dy: grouped casts, not one cast per group
                assert "fusible::fp8_cast_grouped" in names, names
                assert "fusible::fp8_cast" not in names, names
            else:  # delayed scaling: each group's quantizer casts its own tensors
                assert "fusible::fp8_cast_grouped" not in names, names
        else:
            run_grouped()
        y = out["y"]
        with fusible.autocast(recipe=rec):
            yl = [lin(p) for lin, p in zip(linears, xl)]
        for lin_y, part in zip(yl, dy.split(sizes)):
            lin_y.backward(part)
        exact = dict(rtol=0, atol=0)
        torch.testing.assert_close(y, torch.cat(yl), **exact)
        torch.testing.assert_close(xg.grad, torch.cat([p.grad for p in xl]), **exact)
        dws = (
            grouped.weight.grad
            if single
            else [getattr(grouped, f"weight{g}").grad for g in range(G)]
        )
        for g, lin in enumerate(linears):
            want_dw = lin.weight.grad if sizes[g] else torch.zeros_like(lin.weight)
            torch.testing.assert_close(dws[g], want_dw, **exact)
            want_db = lin.bias.grad if sizes[g] else torch.zeros_like(lin.bias)
            torch.testing.assert_close(getattr(grouped, f"bias{g}").grad, want_db, **exact)
        sgd(grouped.parameters())
        for lin in linears:
            if lin.weight.grad is None:  # the empty group's Linear never ran
                continue
            sgd(lin.parameters())
    if kind == "delayed":  # each non-empty group's quantizers as its Linear's
        for g in (0, 2):
            pairs = [("forward", 2 * g, 0), ("forward", 2 * g + 1, 1), ("backward", g, 0)]
            for mode, i, j in pairs:
                lin_q = quantizer(linears[g].basic_ops[0], mode, j)
                for a, b in zip(quantizer(grouped, mode, i), lin_q):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_gemms_per_group_need_rows_in_multiples_of_16():
    """A group of 15 rows: the casts stay emulated (the grouped GEMM in bf16), same recipe."""
    torch.manual_seed(8)
    op = randomized(ops.GroupedLinear(2, 64, 32, device="cpu", dtype=torch.bfloat16))
    x = torch.randn(31, 64).to(torch.bfloat16).requires_grad_()

    def run():
        with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
            op(x, torch.tensor([16, 15])).sum().backward()

    names = _kernel_ops(run)
    assert "fusible::grouped_linear_fwd" in names and "fusible::fp8_gemm" not in names


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
def test_fused_expert_mlp_on_fp8_gemms_equals_its_unfused_plan(device):
    """The MoE expert MLP (GroupedMLP_GroupedGEMMGLU) with FP8 GEMMs per group: fused and unfused
    plans give the same numbers, and the fused backward does not recompute fc2's input (its wgrad
    reads the FP8 input the forward kept)."""
    torch.manual_seed(10)
    dt, sizes = torch.bfloat16, [48, 16, 0]
    fc1 = randomized(ops.GroupedLinear(3, 32, 64, device=device, dtype=dt))
    fc2 = randomized(ops.GroupedLinear(3, 32, 32, device=device, dtype=dt))
    fused = ops.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    unfused = copy.deepcopy(fused)
    split = torch.tensor(sizes, device=device)
    rec = recipe.Float8CurrentScaling()
    for _ in range(3):
        x = torch.randn(64, 32, device=device).to(dt)
        probs = torch.rand(64, device=device).to(dt)
        dy = torch.randn(64, 32, device=device).to(dt)
        outs = []
        for seq, use_fusions in ((fused, True), (unfused, False)):
            snapshot = ops.snapshot_fusions()
            if not use_fusions:
                ops.restore_fusions(([], {}))
            try:
                xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
                with fusible.autocast(recipe=rec):
                    y = seq(xg, split, pg, split)
                y.backward(dy)
                plan = seq.fusion_plan()[0]["forward"]
            finally:
                ops.restore_fusions(snapshot)
            assert ("GroupedMLP_GroupedGEMMGLU" in plan) == use_fusions, plan
            outs.append([y.detach(), xg.grad, pg.grad] + [p.grad.clone() for p in seq.parameters()])
            sgd(seq.parameters())
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    def fused_step():
        xg = torch.randn(64, 32, device=device).to(dt).requires_grad_()
        with fusible.autocast(recipe=rec):
            y = fused(xg, split, torch.rand(64, device=device).to(dt), split)
        y.sum().backward()

    names = _kernel_ops(fused_step)
    assert "fusible::scaled_swiglu_bwd" in names and "fusible::scaled_swiglu_bwd_fwd" not in names


def test_fused_expert_mlp_reads_the_split_sizes_to_the_host_once():
    """Under FP8 the split sizes are read on the host (on CUDA: a wait for the device); the fused
    MLP's two GroupedLinears take the same sizes tensor and read it once per forward."""
    torch.manual_seed(11)
    dt = torch.bfloat16
    fc1 = randomized(ops.GroupedLinear(3, 32, 64, device="cpu", dtype=dt))
    fc2 = randomized(ops.GroupedLinear(3, 32, 32, device="cpu", dtype=dt))
    seq = ops.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    x, probs = torch.randn(64, 32).to(dt), torch.rand(64).to(dt)

    def host_reads(split2):
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            with torch.no_grad(), fusible.autocast(recipe=recipe.Float8CurrentScaling()):
                seq(x, split, probs, split2)
        assert "GroupedMLP_GroupedGEMMGLU" in seq.fusion_plan()[0]["forward"]
        # the int32 sizes [3] made int64 on the host: one copy per read
        return sum(
            1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes[:1] == [[3]]
        )

    split = torch.tensor([32, 16, 16], dtype=torch.int32)
    assert host_reads(split) == 1
    assert host_reads(split.clone()) == 2  # another tensor: read again


def test_fp8_gemms_per_group_skip_a_frozen_experts_weight_gradient():
    torch.manual_seed(12)
    dt, split = torch.bfloat16, torch.tensor([16, 32])
    op = randomized(ops.GroupedLinear(2, 32, 16, device="cpu", dtype=dt))
    x, dy = torch.randn(48, 32).to(dt), torch.randn(48, 16).to(dt)

    def step():
        xg = x.clone().requires_grad_()
        with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
            op(xg, split).backward(dy)
        return xg.grad

    dx = step()
    want = op.weight1.grad.clone()
    op.zero_grad(set_to_none=True)
    op.weight0.requires_grad_(False)
    torch.testing.assert_close(step(), dx, rtol=0, atol=0)
    assert op.weight0.grad is None
    torch.testing.assert_close(op.weight1.grad, want, rtol=0, atol=0)

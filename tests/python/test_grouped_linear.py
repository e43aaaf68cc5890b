"""GroupedLinear (issue 15): te.ops' semantics against a per-group float64 reference, forward and
every gradient; split-size checks; single grouped parameters; deferred init; te.ops keywords.
The CUDA-only properties (no host synchronization, graph capture, device-side checks) are in
test_grouped_linear_cuda.py."""

import pytest
import torch
from conftest import DEVICES, assert_close_to_ref
from fusible import ops

D = torch.float64


def _reference(x, sizes, weights, biases):
    """One torch.nn.functional.linear per group over its rows, concatenated (float64)."""
    rows = x.reshape(-1, x.shape[-1])
    out = [
        torch.nn.functional.linear(xg, w, b)
        for xg, w, b in zip(rows.split(sizes.tolist()), weights, biases)
    ]
    return torch.cat(out).reshape(*x.shape[:-1], weights[0].shape[0])


def _params(op):
    weights = [getattr(op, f"weight{g}") for g in range(op.num_groups)]
    biases = [getattr(op, f"bias{g}", None) for g in range(op.num_groups)]
    return weights, biases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sizes", [[3, 0, 5, 2], [0, 10, 0, 0], [1, 2, 3, 4]])
@pytest.mark.parametrize("in_features", [16, 12])  # 12: not 16-byte rows in bf16 (no CUTLASS path)
def test_against_per_group_float64(device, dtype, index_dtype, bias, sizes, in_features):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 GEMMs: the CUDA run covers them")
    torch.manual_seed(0)
    op = ops.GroupedLinear(4, in_features, 24, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p, dtype=D).to(dtype) * 0.5)
    x = torch.randn(2, 5, in_features, dtype=D).to(device, dtype).requires_grad_()
    split = torch.tensor(sizes, dtype=index_dtype, device=device)
    y = op(x, split)
    weights, biases = _params(op)
    xr = x.detach().double().cpu().requires_grad_()
    wr = [w.detach().double().cpu().requires_grad_() for w in weights]
    br = [b.detach().double().cpu().requires_grad_() if b is not None else None for b in biases]
    ref = _reference(xr, split.cpu(), wr, br)
    assert y.shape == (2, 5, 24) and y.dtype == dtype
    assert_close_to_ref(y, ref, dtype, gemm=True)
    dy = torch.randn(ref.shape, dtype=D).to(dtype)
    y.backward(dy.to(device))
    ref.backward(dy.double())
    got = [x.grad] + [w.grad for w in weights] + [b.grad for b in biases if b is not None]
    want = [xr.grad] + [w.grad for w in wr] + [b.grad for b in br if b is not None]
    for g, w in zip(got, want):
        assert g is not None
        assert_close_to_ref(g, w, dtype, gemm=True)
    empty = [g for g, n in enumerate(sizes) if n == 0]
    for g in empty:  # a group with no rows: zero gradients, not none
        assert torch.count_nonzero(weights[g].grad) == 0


def test_gradcheck_float64():
    torch.manual_seed(1)
    op = ops.GroupedLinear(3, 4, 5, device="cpu", dtype=D)
    split = torch.tensor([2, 0, 3])
    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    params = list(op.parameters())

    def f(x, *_):
        return op(x, split)

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5)


def test_parameters_and_state_dict_follow_te_ops_names():
    op = ops.GroupedLinear(2, 3, 4, device="cpu")
    names = [n for n, _ in op.named_parameters()]
    assert names == ["weight0", "weight1", "bias0", "bias1"]
    assert list(op.state_dict()) == names
    assert torch.count_nonzero(op.bias0) == 0 and op.weight0.abs().max() <= 3**-0.5
    assert not ops.GroupedLinear(2, 3, 4, bias=False, device="cpu").has_bias


@pytest.mark.parametrize(
    "split, match",
    [
        (torch.tensor([2.0, 3.0]), "int32 or int64"),
        (torch.tensor([5]), r"shape \[2\]"),
        (torch.tensor([[2, 3]]), r"shape \[2\]"),
        (torch.tensor([6, -1]), "non-negative"),
        (torch.tensor([2, 2]), "summing to the input's 5 rows"),
    ],
)
def test_bad_split_sizes_are_refused_and_the_op_still_works(split, match):
    op = ops.GroupedLinear(2, 3, 4, device="cpu")
    before = [p.detach().clone() for p in op.parameters()]
    x = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        op(x, split)
    assert all(torch.equal(a, b) for a, b in zip(before, op.parameters()))
    op(x, torch.tensor([2, 3])).sum().backward()
    assert x.grad is not None


def test_deferred_init_on_meta_materializes_at_the_first_forward():
    op = ops.GroupedLinear(2, 3, 4, device="meta")
    assert op.weight0.is_meta
    y = op(torch.randn(4, 3), torch.tensor([1, 3]))
    assert not op.weight0.is_meta and y.shape == (4, 4)
    assert torch.count_nonzero(op.bias1) == 0


def test_in_a_sequential_each_grouped_linear_takes_its_split_sizes():
    torch.manual_seed(2)
    fc1 = ops.GroupedLinear(2, 8, 16, device="cpu", dtype=D)
    fc2 = ops.GroupedLinear(2, 16, 8, device="cpu", dtype=D)
    seq = ops.Sequential(fc1, ops.GELU(), fc2)
    x = torch.randn(6, 8, dtype=D)
    split = torch.tensor([4, 2])
    y = seq(x, split, split)
    h = torch.nn.functional.gelu(fc1(x, split), approximate="tanh")
    torch.testing.assert_close(y, fc2(h, split))


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("delay_wgrad_compute", True),
        ("rng_state_tracker_function", lambda: None),
    ],
)
def test_te_keywords_not_yet_implemented_raise(keyword, value):
    with pytest.raises(NotImplementedError, match=keyword):
        ops.GroupedLinear(2, 3, 4, device="cpu", **{keyword: value})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_scale_bias_against_float64(device, dtype):
    torch.manual_seed(3)
    op = ops.GroupedLinear(3, 8, 6, scale_bias=True, device=device, dtype=dtype)
    assert op.num_extra_inputs == 2 and op._scale_bias
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p))
    sizes = torch.tensor([4, 0, 3], device=device)
    x = torch.randn(7, 8, dtype=dtype, device=device, requires_grad=True)
    s = torch.rand(7, dtype=dtype, device=device, requires_grad=True)
    y = op(x, sizes, s)
    weights, biases = _params(op)
    xr, sr = (t.detach().double().cpu().requires_grad_() for t in (x, s))
    wr = [w.detach().double().cpu().requires_grad_() for w in weights]
    br = [b.detach().double().cpu().requires_grad_() for b in biases]
    rows = [
        xg @ w.T + sg[:, None] * b
        for xg, sg, w, b in zip(xr.split([4, 0, 3]), sr.split([4, 0, 3]), wr, br)
    ]
    ref = torch.cat(rows)
    assert_close_to_ref(y, ref, dtype, gemm=True)
    dy = torch.randn(7, 6, dtype=D)
    y.backward(dy.to(device, dtype))
    ref.backward(dy)
    got = [x.grad, s.grad] + [w.grad for w in weights] + [b.grad for b in biases]
    want = [xr.grad, sr.grad] + [w.grad for w in wr] + [b.grad for b in br]
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, dtype, gemm=True)


def test_scale_bias_checks_the_scales():
    op = ops.GroupedLinear(2, 3, 4, scale_bias=True, device="cpu")
    with pytest.raises(RuntimeError, match=r"scales of shape \[5\]"):
        op(torch.randn(5, 3), torch.tensor([2, 3]), torch.rand(4))
    assert (
        ops.GroupedLinear(2, 3, 4, bias=False, scale_bias=True, device="cpu").num_extra_inputs == 1
    )


def test_main_grad_accumulates_per_weight():
    torch.manual_seed(4)
    op = ops.GroupedLinear(2, 3, 4, device="cpu", dtype=D, accumulate_into_main_grad=True)
    for g in range(2):
        getattr(op, f"weight{g}").main_grad = torch.zeros(4, 3, dtype=D)
    want = [torch.zeros(4, 3, dtype=D) for _ in range(2)]
    for _ in range(2):
        x, dy = torch.randn(5, 3, dtype=D), torch.randn(5, 4, dtype=D)
        op(x, torch.tensor([2, 3])).backward(dy)
        want[0] += dy[:2].T @ x[:2]
        want[1] += dy[2:].T @ x[2:]
    for g in range(2):
        torch.testing.assert_close(getattr(op, f"weight{g}").main_grad, want[g])
        assert getattr(op, f"weight{g}").grad is None
    assert op.bias0.grad is not None


class _Router(ops.BasicOperation):
    """y = x; extra outputs: split sizes (int64: half the rows to expert 0, the rest to expert 2)
    and per-row probabilities sigmoid(sum(x)), differentiable."""

    num_extra_outputs = 2

    def fuser_forward(self, ctxs, input_, *, basic_op_extra_inputs, **unused):
        rows = input_.shape[0]
        sizes = torch.tensor([rows // 2, 0, rows - rows // 2])
        ctxs[0].save_for_backward(input_)
        return input_, [[sizes, torch.sigmoid(input_.sum(-1))]]

    def fuser_backward(self, ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (x,) = ctxs[0].saved_tensors
        dprobs = basic_op_grad_extra_outputs[0][1]
        s = torch.sigmoid(x.sum(-1))
        return grad_output + (dprobs * s * (1 - s))[:, None], [[]], [[]]


def test_a_router_feeds_split_sizes_and_probabilities_through_channels():
    torch.manual_seed(5)
    router = _Router()
    router.set_extra_output_channel(0, "sizes", output_to_caller=False)
    router.set_extra_output_channel(1, "probs", output_to_caller=False)
    experts = ops.GroupedLinear(3, 4, 5, scale_bias=True, device="cpu", dtype=D)
    experts.set_extra_input_channel(0, "sizes").set_extra_input_channel(1, "probs")
    x = torch.randn(6, 4, dtype=D, requires_grad=True)
    y = ops.Sequential(router, experts)(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    s = torch.sigmoid(xr.sum(-1))
    w = [getattr(experts, f"weight{g}").detach() for g in range(3)]
    b = [getattr(experts, f"bias{g}").detach() for g in range(3)]
    ref = torch.cat([xr[:3] @ w[0].T + s[:3, None] * b[0], xr[3:] @ w[2].T + s[3:, None] * b[2]])
    ref.backward(dy)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, xr.grad)  # through the probabilities too
    assert torch.count_nonzero(experts.weight1.grad) == 0  # expert 1 got no rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("single_weight, single_bias", [(True, True), (True, False), (False, True)])
def test_single_grouped_parameters_match_per_group_ones(device, dtype, single_weight, single_bias):
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 GEMMs: the CUDA run covers them")
    torch.manual_seed(6)
    kw = dict(scale_bias=True, device=device, dtype=dtype)
    per_group = ops.GroupedLinear(3, 16, 8, **kw)
    single = ops.GroupedLinear(
        3, 16, 8, single_grouped_weight=single_weight, single_grouped_bias=single_bias, **kw
    )
    names = [n for n, _ in single.named_parameters()]
    want_names = (["weight"] if single_weight else ["weight0", "weight1", "weight2"]) + (
        ["bias"] if single_bias else ["bias0", "bias1", "bias2"]
    )
    assert names == want_names and single.single_grouped_weight == single_weight
    if single_weight:
        assert single.weight.shape == (3, 8, 16)
    if single_bias:
        assert single.bias.shape == (3, 8) and torch.count_nonzero(single.bias) == 0
    with torch.no_grad():
        for g in range(3):
            w, b = torch.randn(8, 16), torch.randn(8)
            getattr(per_group, f"weight{g}").copy_(w)
            getattr(per_group, f"bias{g}").copy_(b)
            (single.weight[g] if single_weight else getattr(single, f"weight{g}")).copy_(w)
            (single.bias[g] if single_bias else getattr(single, f"bias{g}")).copy_(b)
    sizes = torch.tensor([5, 0, 4], device=device)
    x = torch.randn(9, 16, device=device, dtype=dtype)
    s = torch.rand(9, device=device, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    sa, sb = s.clone().requires_grad_(), s.clone().requires_grad_()
    ya, yb = per_group(xa, sizes, sa), single(xb, sizes, sb)
    torch.testing.assert_close(yb, ya)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xb.grad, xa.grad)
    torch.testing.assert_close(sb.grad, sa.grad)
    for name, stacked in (("weight", single_weight), ("bias", single_bias)):
        want = torch.stack([getattr(per_group, f"{name}{g}").grad for g in range(3)])
        got = (
            getattr(single, name).grad
            if stacked
            else torch.stack([getattr(single, f"{name}{g}").grad for g in range(3)])
        )
        torch.testing.assert_close(got, want)


def test_per_group_parameters_share_one_buffer_and_a_swapped_one_still_works():
    op = ops.GroupedLinear(3, 4, 5, device="cpu", dtype=D)
    step = 4 * 5 * D.itemsize
    ptrs = [getattr(op, f"weight{g}").data_ptr() for g in range(3)]
    assert ptrs == [ptrs[0], ptrs[0] + step, ptrs[0] + 2 * step]
    meta = ops.GroupedLinear(3, 4, 5, device="meta", dtype=D)
    meta(torch.randn(2, 4, dtype=D), torch.tensor([1, 1, 0]))
    ptrs = [getattr(meta, f"bias{g}").data_ptr() for g in range(3)]
    assert ptrs == [ptrs[0], ptrs[0] + 5 * D.itemsize, ptrs[0] + 10 * D.itemsize]
    op.weight1 = torch.nn.Parameter(torch.randn(5, 4, dtype=D))  # its own storage: gathered
    x = torch.randn(6, 4, dtype=D, requires_grad=True)
    y = op(x, torch.tensor([1, 3, 2]))
    weights, biases = _params(op)
    ref = _reference(x, torch.tensor([1, 3, 2]), weights, biases)
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    torch.testing.assert_close(op.weight1.grad, torch.ones(3, 5, dtype=D).T @ x[1:4].detach())


@pytest.mark.parametrize("name", ["weight0", "weight2", "bias1"])
def test_an_in_place_change_before_the_backward_raises(name):
    """The grouped weight (bias) the forward saves is a view of group 0's parameter: a change to
    any group's parameter between forward and backward raises, as it does for a Linear, instead
    of a backward with the new values."""
    op = ops.GroupedLinear(3, 4, 5, scale_bias=True, device="cpu", dtype=D)
    x = torch.randn(6, 4, dtype=D, requires_grad=True)
    y = op(x, torch.tensor([1, 3, 2]), torch.rand(6, dtype=D, requires_grad=True))
    with torch.no_grad():
        getattr(op, name).mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):  # group 0's: its view's wording
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows(device):
    op = ops.GroupedLinear(2, 8, 8, scale_bias=True, device=device)
    x = torch.randn(0, 8, device=device, requires_grad=True)
    s = torch.rand(0, device=device, requires_grad=True)
    y = op(x, torch.zeros(2, dtype=torch.int32, device=device), s)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8) and s.grad.shape == (0,)
    assert torch.count_nonzero(op.weight0.grad) == 0 and torch.count_nonzero(op.bias1.grad) == 0


def test_main_grad_with_a_single_grouped_weight():
    torch.manual_seed(7)
    op = ops.GroupedLinear(
        2, 3, 4, device="cpu", dtype=D, accumulate_into_main_grad=True, single_grouped_weight=True
    )
    op.weight.main_grad = torch.zeros(2, 4, 3, dtype=D)
    x, dy = torch.randn(5, 3, dtype=D), torch.randn(5, 4, dtype=D)
    op(x, torch.tensor([2, 3])).backward(dy)
    want = torch.stack([dy[:2].T @ x[:2], dy[2:].T @ x[2:]])
    torch.testing.assert_close(op.weight.main_grad, want)
    assert op.weight.grad is None


def _expert_mlp(device, dtype, bias, interleave=None):
    """Router -> GroupedLinear -> ScaledSwiGLU -> GroupedLinear, split sizes and probabilities
    routed by channels (the MoE expert MLP)."""
    torch.manual_seed(9)
    router = _Router()
    router.set_extra_output_channel(0, "sizes", output_to_caller=False)
    router.set_extra_output_channel(1, "probs", output_to_caller=False)
    fc1 = ops.GroupedLinear(3, 16, 32, bias=bias, device=device, dtype=dtype)
    act = ops.ScaledSwiGLU(interleave)
    fc2 = ops.GroupedLinear(3, 16, 8, bias=bias, device=device, dtype=dtype)
    fc1.set_extra_input_channel(0, "sizes")
    act.set_extra_input_channel(0, "probs")
    fc2.set_extra_input_channel(0, "sizes")
    with torch.no_grad():
        for p in [*fc1.parameters(), *fc2.parameters()]:
            p.copy_(torch.randn_like(p) * 0.3)
    return ops.Sequential(router, fc1, act, fc2)


def _mlp_step(seq, x, dy):
    x = x.detach().clone().requires_grad_()
    for p in seq.parameters():
        p.grad = None
    y = seq(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in seq.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_expert_mlp_equals_its_unfused_plan(device, dtype, bias):
    seq = _expert_mlp(device, dtype, bias)
    x = torch.randn(10, 16, device=device, dtype=dtype)
    dy = torch.randn(10, 8, device=device, dtype=dtype)
    fused = _mlp_step(seq, x, dy)
    plan = seq.fusion_plan()[0]
    assert plan["forward"] == plan["backward"] == ["_Router", "GroupedMLP_GroupedGEMMGLU"]
    snapshot = ops.snapshot_fusions()
    ops.restore_fusions(([], {}))  # no fusions at all: the unfused plan
    try:
        unfused = _mlp_step(seq, x, dy)
        assert seq.fusion_plan()[0]["forward"][1:] == [
            "GroupedLinear",
            "ScaledSwiGLU",
            "GroupedLinear",
        ]
    finally:
        ops.restore_fusions(snapshot)
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)  # the same kernels on the same operands


@pytest.mark.parametrize("device", DEVICES)
def test_fused_expert_mlp_against_float64(device):
    seq = _expert_mlp(device, torch.float32, True)
    x = torch.randn(10, 16).to(device)
    dy = torch.randn(10, 8).to(device)
    got = _mlp_step(seq, x, dy)
    assert seq.fusion_plan()[0]["forward"][1] == "GroupedMLP_GroupedGEMMGLU"
    xr = x.cpu().double().requires_grad_()
    s = torch.sigmoid(xr.sum(-1))
    w1 = [getattr(seq[1], f"weight{g}").detach().double().cpu().requires_grad_() for g in range(3)]
    b1 = [getattr(seq[1], f"bias{g}").detach().double().cpu().requires_grad_() for g in range(3)]
    w2 = [getattr(seq[3], f"weight{g}").detach().double().cpu().requires_grad_() for g in range(3)]
    b2 = [getattr(seq[3], f"bias{g}").detach().double().cpu().requires_grad_() for g in range(3)]

    def expert(rows, g):
        h = rows @ w1[g].T + b1[g]
        gate, lin = h.chunk(2, -1)
        return (s_rows[g][:, None] * torch.nn.functional.silu(gate) * lin) @ w2[g].T + b2[g]

    s_rows = {0: s[:5], 2: s[5:]}
    ref = torch.cat([expert(xr[:5], 0), expert(xr[5:], 2)])
    ref.backward(dy.cpu().double())
    params = (*w1, *b1, *w2, *b2)  # expert 1 gets no rows: zero gradients
    want = [ref, xr.grad] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in params]
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, torch.float32, gemm=True)


def test_fused_expert_mlp_declines_where_its_conditions_fail():
    interleaved = _expert_mlp("cpu", D, True, interleave=8)
    interleaved(torch.randn(4, 16, dtype=D))
    assert "GroupedMLP_GroupedGEMMGLU" not in interleaved.fusion_plan()[0]["forward"]
    fc1 = ops.GroupedLinear(3, 16, 32, device="cpu")
    other_groups = ops.Sequential(
        fc1, ops.ScaledSwiGLU(), ops.GroupedLinear(2, 16, 8, device="cpu")
    )
    other_groups(torch.randn(4, 16), torch.tensor([4, 0, 0]), torch.rand(4), torch.tensor([1, 3]))
    assert other_groups.fusion_plan()[0]["forward"] == [
        "GroupedLinear",
        "ScaledSwiGLU",
        "GroupedLinear",
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single", [False, True])
def test_one_group(device, single):
    torch.manual_seed(10)
    op = ops.GroupedLinear(
        1, 8, 4, device=device, dtype=D, single_grouped_weight=single, single_grouped_bias=single
    )
    x = torch.randn(5, 8, dtype=D, device=device, requires_grad=True)
    y = op(x, torch.tensor([5], device=device))
    w = op.weight[0] if single else op.weight0
    b = op.bias[0] if single else op.bias0
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 4, dtype=D, device=device) @ w.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_op_kwargs_output_and_grad_input_buffers(device):
    """te.ops' GroupedLinear buffers: the output and the input's gradient are the caller's
    tensors, with the unbuffered values."""
    torch.manual_seed(12)
    op = ops.GroupedLinear(3, 8, 6, device=device, dtype=D)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p))
    sizes = torch.tensor([3, 0, 7], device=device)
    x = torch.randn(2, 5, 8, device=device, dtype=D, requires_grad=True)
    dy = torch.randn(2, 5, 6, device=device, dtype=D)
    seq = ops.Sequential(op)
    out = torch.full((2, 5, 6), float("nan"), device=device, dtype=D)
    grad_in = torch.full((2, 5, 8), float("nan"), device=device, dtype=D)
    y = seq(x, sizes, op_kwargs={op: {"output": out, "grad_input": grad_in}})
    assert y.data_ptr() == out.data_ptr()
    y.backward(dy)
    assert x.grad.data_ptr() == grad_in.data_ptr() or torch.equal(x.grad, grad_in)
    xr = x.detach().clone().requires_grad_()
    weights, biases = _params(op)
    ref = _reference(xr, sizes.cpu(), [w.detach() for w in weights], [b.detach() for b in biases])
    (ref_dx,) = torch.autograd.grad(ref, xr, dy)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad_in, ref_dx)
    torch.testing.assert_close(x.grad, ref_dx)
    # A plain call afterwards uses no buffer.
    y2 = seq(x, sizes)
    assert y2.data_ptr() != out.data_ptr()
    torch.testing.assert_close(y2, ref)


def test_op_kwargs_buffer_errors():
    op = ops.GroupedLinear(2, 4, 3, device="cpu", dtype=D)
    x, sizes = torch.randn(5, 4, dtype=D), torch.tensor([2, 3])
    with pytest.raises(ValueError, match='"output" buffer'):
        op(x, sizes, output=torch.empty(5, 4, dtype=D))
    with pytest.raises(ValueError, match='"output" buffer'):
        op(x, sizes, output=torch.empty(5, 3))  # float32, not the compute dtype
    with pytest.raises(ValueError, match="pass buffer.detach"):
        op(x, sizes, output=torch.empty(5, 3, dtype=D, requires_grad=True))
    with pytest.raises(TypeError, match="takes only"):
        op(x, sizes, out=torch.empty(5, 3, dtype=D))
    with pytest.raises(TypeError, match="built-in ops take none"):
        ops.Bias(4, device="cpu", dtype=D)(x, weight=torch.empty(1))
    torch.testing.assert_close(op(x, sizes), op(x, sizes))  # nothing left behind


def test_fused_expert_mlp_takes_the_buffers():
    """fc2's output and fc1's input gradient into the caller's buffers in the fused op too."""
    _, fc1, act, fc2 = _expert_mlp("cpu", D, True)
    seq = ops.Sequential(fc1, act, fc2)  # split sizes and probabilities from the caller
    x, dy = torch.randn(10, 16, dtype=D), torch.randn(10, 8, dtype=D)
    named = {"sizes": torch.tensor([4, 0, 6]), "probs": torch.rand(10, dtype=D)}

    def step(op_kwargs=None):
        xb = x.clone().requires_grad_()
        y = seq(xb, channel_inputs=named, op_kwargs=op_kwargs)
        y.backward(dy)
        assert seq.fusion_plan()[0]["forward"] == ["GroupedMLP_GroupedGEMMGLU"]
        return y, xb.grad

    want_y, want_dx = step()
    out, grad_in = torch.empty(10, 8, dtype=D), torch.empty(10, 16, dtype=D)
    y, dx = step({fc2: {"output": out}, fc1: {"grad_input": grad_in}})
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(out, want_y) and torch.equal(grad_in, want_dx) and torch.equal(dx, want_dx)

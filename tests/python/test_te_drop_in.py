"""Issue 14 (te.ops drop-in), first part: te.ops' module layout, Sequential(OrderedDict), the
Python-op protocol's context, and te.ops keywords that fusible does not implement raising
NotImplementedError (never TypeError)."""

import collections
import importlib
import inspect

import pytest
import torch
from fusible import ops

D = torch.float64


@pytest.mark.parametrize(
    "module, names",
    [
        (
            "fusible.ops.op",
            ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext"],
        ),
        (
            "fusible.ops.fuser",
            ["OperationFuser", "register_forward_fusion", "register_backward_fusion"],
        ),
        ("fusible.ops.sequential", ["Sequential"]),
        ("fusible.ops.linear", ["Linear"]),
        (
            "fusible.ops.basic",
            ["BasicLinear", "Bias", "LayerNorm", "RMSNorm", "SwiGLU", "Quantize"],
        ),
        ("fusible.ops.fused", []),
    ],
)
def test_te_ops_module_layout(module, names):
    m = importlib.import_module(module)
    for n in names:
        assert getattr(m, n) is getattr(ops, n), (module, n)


def test_basic_module_lists_every_basic_op():
    basic = importlib.import_module("fusible.ops.basic")
    for n in basic.__all__:
        cls = getattr(basic, n)
        assert issubclass(cls, ops.BasicOperation)


def test_sequential_from_ordered_dict_keeps_names():
    torch.manual_seed(0)
    lin = ops.Linear(4, 3, device="cpu", dtype=D)
    seq = ops.Sequential(collections.OrderedDict([("fc", lin), ("act", ops.ReLU())]))
    assert [n for n, _ in seq.named_children()] == ["fc", "act"]
    assert set(seq.state_dict()) == {"fc.weight", "fc.bias"}
    x = torch.randn(2, 4, dtype=D)
    torch.testing.assert_close(seq(x), torch.relu(x @ lin.weight.T + lin.bias))
    seq.append(ops.Identity())
    assert len(seq) == 3


def test_empty_fused_operation_is_a_value_error():
    with pytest.raises(ValueError, match="at least one basic op"):
        ops.FusedOperation([])


def test_operation_context_is_constructible_with_te_fields():
    ctx = ops.OperationContext()
    ctx.requires_grad = True
    ctx.dtype = torch.bfloat16
    assert ctx.dtype == torch.bfloat16 and ctx.compute_dtype == torch.bfloat16
    t = torch.ones(2)
    ctx.to_save = (t, None)
    assert ctx.to_save[0] is not None and torch.equal(ctx.to_save[0], t) and ctx.to_save[1] is None
    with pytest.raises(AttributeError, match="saved_tensors is set by the fuser"):
        ctx.saved_tensors  # before the fuser hands them over: an error, not to_save
    with pytest.raises(AttributeError):
        ctx.extra_input_requires_grad = [True]  # a read-only field stays read-only
    ctx.custom = 3  # any attribute, as te.ops' contexts
    assert ctx.custom == 3


class _SaveByAssignment(ops.BasicOperation):
    """y = 2 x, saving x by assigning ctx.to_save (te.ops' fuser reads that field)."""

    def op_forward(self, ctx, input_, **unused):
        ctx.to_save = (input_,)
        return 2 * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        assert x is not None
        return 2 * grad_output, ()


def test_a_python_op_may_assign_to_save():
    op = _SaveByAssignment()
    x = torch.randn(3, dtype=D, requires_grad=True)
    op(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize(
    "make, keyword",
    [
        (lambda: ops.LayerNorm(8, sm_margin=4), "sm_margin"),
        (lambda: ops.Linear(8, 8, rng_state_tracker_function=lambda: None), "rng_state_tracker"),
        (lambda: ops.BasicLinear(8, 8, userbuffers_options={}), "userbuffers_options"),
    ],
)
def test_unimplemented_te_keywords_raise_not_implemented(make, keyword):
    with pytest.raises(NotImplementedError, match=keyword):
        make()


def test_te_keywords_at_their_defaults_are_accepted():
    x = torch.randn(2, 8, dtype=D)
    ref = ops.SwiGLU()(x)
    torch.testing.assert_close(ops.SwiGLU(glu_interleave_size=None)(x), ref)
    ops.ClampedSwiGLU(glu_interleave_size=None, glu_linear_offset=1.0)
    ops.ScaledSwiGLU(glu_interleave_size=None, activation_recompute_in_mlp=False)


@pytest.mark.parametrize(
    "cls", ["ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU", "ScaledSReLU"]
)
def test_activation_recompute_in_mlp_is_an_attribute(cls):
    """te.ops' attribute; fusible's fused expert MLP recomputes fc2's input either way, so both
    values compute the same; read-only after construction."""
    on, off = getattr(ops, cls)(activation_recompute_in_mlp=True), getattr(ops, cls)()
    assert on.activation_recompute_in_mlp is True and off.activation_recompute_in_mlp is False
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    scales = torch.rand(4, dtype=D, requires_grad=True)
    torch.testing.assert_close(on(x, scales), off(x, scales), rtol=0, atol=0)
    with pytest.raises(AttributeError):
        on.activation_recompute_in_mlp = False


@pytest.mark.parametrize(
    "x_shape, extra_shape",
    [((4, 6), (6,)), ((4, 6), (1, 6)), ((1, 6), (4, 6)), ((2, 3, 6), (3, 1)), ((4, 6), (4, 6))],
)
@pytest.mark.parametrize("in_place", [False, True])
def test_add_extra_input_broadcasts(x_shape, extra_shape, in_place):
    torch.manual_seed(1)
    x = torch.randn(x_shape, dtype=D, requires_grad=True)
    extra = torch.randn(extra_shape, dtype=D, requires_grad=True)
    op = ops.AddExtraInput(in_place=in_place)
    ref = x + extra
    if in_place and ref.shape != extra.shape:  # te.ops' extra += x raises: it cannot hold the sum
        with pytest.raises(RuntimeError, match="expected an extra input that holds the sum"):
            op(x, extra.clone())
        return
    y = op(x, extra.clone() if in_place else extra)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    dy = torch.randn_like(ref)
    gx, ge = torch.autograd.grad(y, [x, extra], dy)
    rx, re = torch.autograd.grad(ref, [x, extra], dy)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(ge, re)
    assert gx.shape == x.shape and ge.shape == extra.shape


def test_linear_then_broadcast_add_falls_back_to_the_add():
    torch.manual_seed(2)
    seq = ops.Sequential(ops.Linear(8, 6, device="cpu", dtype=D), ops.AddExtraInput())
    lin = seq[0]
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    extra = torch.randn(6, dtype=D, requires_grad=True)
    y = seq(x, extra)
    ref = x @ lin.weight.T + lin.bias + extra
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, extra, lin.weight], dy)
    want = torch.autograd.grad(ref, [x, extra, lin.weight], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_add_extra_input_that_does_not_broadcast_is_refused():
    with pytest.raises(
        RuntimeError, match="AddExtraInput: expected an extra input that broadcasts"
    ):
        ops.AddExtraInput()(torch.randn(4, 6), torch.randn(5))


class _LinearThenScale(ops.FusedOperation):
    """A Python fused op over BasicLinear + ConstantScale (forward only)."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        lin, scale = self.basic_ops
        return lin.weight.new_tensor(scale.scale) * (input_ @ lin.weight.T), [(), ()]


def test_python_fused_op_basic_ops_are_submodules():
    lin = ops.BasicLinear(4, 3, device="cpu", dtype=D)
    fused = _LinearThenScale([lin, ops.ConstantScale(0.5)])
    assert isinstance(fused.basic_ops, torch.nn.ModuleList)
    assert [p for p in fused.parameters()] == [lin.weight]
    assert list(fused.state_dict()) == ["basic_ops.0.weight"]


def _te_linear_checkpoint(lin, extra_state):
    """What te.ops' Linear writes: parameters under its basic ops, one _extra_state per basic op
    (built by hand here, as te.ops would, with no FP8 state)."""
    return collections.OrderedDict(
        [
            ("basic_ops.0.weight", lin.weight.detach().clone()),
            ("basic_ops.0._extra_state", extra_state),
            ("basic_ops.1.bias", lin.bias.detach().clone()),
            ("basic_ops.1._extra_state", extra_state),
        ]
    )


@pytest.mark.parametrize("extra_state", [None, torch.empty(0)])
def test_a_te_ops_linear_checkpoint_loads_strictly(extra_state):
    torch.manual_seed(3)
    src = ops.Linear(6, 4, device="cpu", dtype=D)
    dst = ops.Linear(6, 4, device="cpu", dtype=D)
    dst.load_state_dict(_te_linear_checkpoint(src, extra_state), strict=True)
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
    # Nested in a Sequential, under the Sequential's prefixes.
    seq = ops.Sequential(ops.Linear(6, 4, device="cpu", dtype=D), ops.GELU())
    nested = {f"0.{k}": v for k, v in _te_linear_checkpoint(src, extra_state).items()}
    seq.load_state_dict(nested, strict=True)
    assert torch.equal(seq[0].weight, src.weight)


def test_te_ops_fp8_metadata_is_refused_clearly():
    src = ops.Linear(6, 4, device="cpu", dtype=D)
    with pytest.raises(NotImplementedError, match="basic_ops.0._extra_state"):
        ops.Linear(6, 4, device="cpu", dtype=D).load_state_dict(
            _te_linear_checkpoint(src, torch.ones(8, dtype=torch.uint8))
        )


def test_te_ops_state_dict_round_trip():
    torch.manual_seed(4)
    seq = ops.Sequential(
        ops.LayerNorm(6, device="cpu", dtype=D), ops.Linear(6, 4, device="cpu", dtype=D)
    )
    te = ops.te_ops_state_dict(seq)
    assert list(te) == ["0.weight", "0.bias", "1.basic_ops.0.weight", "1.basic_ops.1.bias"]
    other = ops.Sequential(
        ops.LayerNorm(6, device="cpu", dtype=D), ops.Linear(6, 4, device="cpu", dtype=D)
    )
    other.load_state_dict(te, strict=True)
    for a, b in zip(seq.parameters(), other.parameters()):
        assert torch.equal(a, b)
    # A torch.nn.Linear checkpoint loads as well.
    ref = torch.nn.Linear(6, 4, dtype=D)
    lin = ops.Linear(6, 4, device="cpu", dtype=D)
    lin.load_state_dict(ref.state_dict(), strict=True)
    assert torch.equal(lin.weight, ref.weight)


def test_attributes_te_fusion_functions_read():
    lin = ops.BasicLinear(4, 4, device="cpu")
    assert lin.tensor_parallel_mode is None and lin.tensor_parallel_size == 1
    assert lin.sequence_parallel is False and lin._accumulate_into_main_grad is False
    assert ops.AddExtraInput(in_place=True)._in_place is True
    assert ops.MakeExtraOutput()._in_place is False
    assert ops.Dropout(0.25).dropout_probability == 0.25
    assert ops.Reshape((2, -1))._shape == (2, -1)
    clamped = ops.ScaledClampedQGeGLU(limit=3.0, glu_linear_offset=0.5)._clamped
    assert (clamped.limit, clamped.alpha, clamped.glu_linear_offset) == (3.0, 1.702, 0.5)


# te.ops' ops.basic at TransformerEngine 2.20 (the newest release read), less the names of the
# grouped (issue 15) and tensor-parallel (issue 16) work.
TE_BASIC = """GELU GEGLU GLU QGELU QGEGLU ReLU ReGLU SReLU ScaledSReLU ScaledTanhSReLU SReGLU SiLU
AddExtraInput BasicLinear Bias ConstantScale Dropout Identity L2Normalization LayerNorm
MakeExtraOutput Quantize Reshape RMSNorm ClampedSwiGLU ScaledClampedQGeGLU ScaledSiTUGLU
ScaledSwiGLU SiTUGLU SwiGLU""".split()
TE_FUSED = """BackwardActivationBias BackwardAddRMSNorm BackwardLinearAdd BackwardLinearScale
ForwardLinearBiasActivation ForwardLinearBiasAdd ForwardLinearScaleAdd""".split()


def test_every_te_ops_name_outside_the_grouped_and_parallel_work_exists():
    basic = importlib.import_module("fusible.ops.basic")
    fused = importlib.import_module("fusible.ops.fused")
    assert [n for n in TE_BASIC if not hasattr(basic, n) or not hasattr(ops, n)] == []
    assert [n for n in TE_FUSED if not hasattr(fused, n)] == []
    for name in ("Linear", "Sequential", "BasicOperation", "FusedOperation", "FusibleOperation"):
        assert hasattr(ops, name)


def test_te_call_forms_of_the_constructors_and_containers():
    """te.ops' positional and dict forms, which te.ops code writes."""
    q = ops.Quantize(True, True)  # te.ops: positional-or-keyword
    assert q._quantize_forward and q._quantize_backward
    assert "reduce_in_backward" in inspect.signature(ops.AllReduce).parameters
    first, second = ops.Bias(3, device="cpu", dtype=D), ops.GELU()
    seq = ops.Sequential({"bias": first, "act": second})  # a plain dict, in its order
    assert [n for n, _ in seq.named_children()] == ["bias", "act"]
    assert seq.insert(0, ops.Identity()) is seq  # chains, as torch's and te.ops' insert
    assert list(seq)[1:] == [first, second]


def test_te_keywords_that_change_no_result_are_accepted():
    x = torch.randn(3, 8, dtype=D)
    # L2Normalization's JIT warm-up sizes (te.ops) compute nothing else.
    warm = ops.L2Normalization(seq_length=128, micro_batch_size=2)
    assert warm.seq_length == 128 and warm.micro_batch_size == 2
    torch.testing.assert_close(warm(x), ops.L2Normalization()(x), rtol=0, atol=0)
    assert repr(warm) == "L2Normalization(eps=1e-06)"
    # sm_margin as te.ops' per-pass dict: zeros are what runs; any other margin is refused.
    zeros = {"forward": 0, "backward": 0, "inference": 0}
    ln = ops.LayerNorm(8, sm_margin=zeros, dtype=D, device="cpu")
    torch.testing.assert_close(ln(x), ops.LayerNorm(8, dtype=D, device="cpu")(x), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="sm_margin=2"):
        ops.RMSNorm(8, sm_margin={"forward": 0, "backward": 2})

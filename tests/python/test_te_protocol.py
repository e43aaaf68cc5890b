"""Issue 14 (te.ops drop-in), the Python-op protocol in full: op_kwargs / basic_op_kwargs /
**kwargs reaching op_forward, pre_first_fuser_forward and pre_fuser_forward called in te.ops'
order, and fusion functions seeing the recipe object and built-in fused ops with basic_ops."""

import fusible
import pytest
import torch
from fusible import ops, recipe

D = torch.float64


@pytest.fixture(autouse=True)
def isolated_registry():
    snap = ops.snapshot_fusions()
    yield
    ops.restore_fusions(snap)


class Shift(ops.BasicOperation):
    """y = x + shift, shift an op_forward keyword (default 0); records hook calls in `log`."""

    def __init__(self, log=None, name="shift"):
        super().__init__()
        self.log, self.name = log if log is not None else [], name

    def pre_first_fuser_forward(self):
        self.log.append((self.name, "first"))

    def pre_fuser_forward(self, *, requires_grad):
        self.log.append((self.name, "pre", requires_grad))

    def op_forward(self, ctx, input_, *, shift=0.0, **unused):
        self.log.append((self.name, "forward", shift))
        return input_ + shift

    def op_backward(self, ctx, grad_output):
        return grad_output, []


class Twice(ops.FusedOperation):
    """A Python fused op over two Shift ops that applies both shifts itself."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_kwargs, **unused):
        total = sum(kw.get("shift", 0.0) for kw in basic_op_kwargs)
        return input_ + total, [[], []]


def test_sequential_op_kwargs_by_op_and_by_index():
    a, b = Shift(name="a"), Shift(name="b")
    seq = ops.Sequential(a, ops.ConstantScale(2.0), b)
    x = torch.randn(3, 4, dtype=D)
    y = seq(x, op_kwargs={a: {"shift": 1.0}, 2: {"shift": 0.5}})
    torch.testing.assert_close(y, 2 * (x + 1.0) + 0.5)
    torch.testing.assert_close(seq(x), 2 * x)  # the keywords lasted one call


def test_op_kwargs_errors():
    a = Shift()
    seq = ops.Sequential(a, ops.Linear(4, 4, device="cpu", dtype=D))
    x = torch.randn(2, 4, dtype=D)
    with pytest.raises(ValueError, match="not in this Sequential"):
        seq(x, op_kwargs={Shift(): {"shift": 1.0}})
    with pytest.raises(ValueError, match="not a basic operation"):
        seq(x, op_kwargs={1: {"shift": 1.0}})  # a Linear is a fused op
    with pytest.raises(TypeError, match="built-in ops take none"):
        seq(x, op_kwargs={seq[1].basic_ops[0]: {"shift": 1.0}})
    seq(x)  # still usable


def test_keywords_for_one_op_object_at_two_positions_are_refused():
    """The keywords reach an op object: one object at two positions cannot take two dicts (they
    reached both positions), nor may two keys name one op."""
    s = Shift()
    x = torch.zeros(1, 2, dtype=D)
    fuser = ops.OperationFuser([s, ops.ConstantScale(10.0), s])
    with pytest.raises(ValueError, match="basic op 0 and 2"):
        fuser(x, basic_op_kwargs=[{}, {}, {"shift": 1.0}])
    # The same keywords at both positions mean what they say.
    torch.testing.assert_close(
        fuser(x, basic_op_kwargs=[{"shift": 1.0}, {}, {"shift": 1.0}]), (x + 1) * 10 + 1
    )
    seq = ops.Sequential(s, ops.ConstantScale(10.0), s)
    with pytest.raises(ValueError, match="more than once"):
        seq(x, op_kwargs={2: {"shift": 1.0}})
    t = Shift()
    seq2 = ops.Sequential(t, ops.ConstantScale(10.0))
    with pytest.raises(ValueError, match="names Shift twice"):
        seq2(x, op_kwargs={t: {"shift": 1.0}, 0: {"shift": 5.0}})
    with pytest.raises(IndexError, match="op_kwargs index 7 is out of range"):
        seq2(x, op_kwargs={7: {"shift": 1.0}})
    torch.testing.assert_close(seq2(x, op_kwargs={0: {"shift": 2.0}}), (x + 2) * 10)


def test_fuser_and_standalone_calls_pass_keywords():
    a, b = Shift(name="a"), Shift(name="b")
    x = torch.randn(2, 4, dtype=D)
    fuser = ops.OperationFuser([a, ops.ConstantScale(3.0), b])
    torch.testing.assert_close(
        fuser(x, basic_op_kwargs=[{"shift": 1.0}, {}, {"shift": -2.0}]), 3 * (x + 1) - 2
    )
    with pytest.raises(ValueError, match="one dict per basic op"):
        fuser(x, basic_op_kwargs=[{}])
    torch.testing.assert_close(a(x, shift=0.25), x + 0.25)
    with pytest.raises(TypeError, match="built-in"):
        ops.ConstantScale(2.0)(x, scale=3.0)


def test_python_fused_op_receives_basic_op_kwargs():
    twice = Twice([Shift(), Shift()])
    x = torch.randn(2, 4, dtype=D)
    y = twice(x, basic_op_kwargs=[{"shift": 1.0}, {"shift": 2.0}])
    torch.testing.assert_close(y, x + 3.0)


def test_pre_forward_hooks_run_in_te_order():
    log = []
    a, b = Shift(log, "a"), Shift(log, "b")
    lin = ops.Linear(4, 4, device="cpu", dtype=D)
    seq = ops.Sequential(a, lin, b)
    x = torch.randn(2, 4, dtype=D)  # no grad on x: a needs no backward, lin and b do
    seq(x)
    assert log[:4] == [("a", "first"), ("b", "first"), ("a", "pre", False), ("b", "pre", True)]
    log.clear()
    seq(x)  # not the first call any more
    assert log[:2] == [("a", "pre", False), ("b", "pre", True)]
    log.clear()
    with torch.no_grad():
        seq(x)
    assert log[:2] == [("a", "pre", False), ("b", "pre", False)]
    log.clear()
    seq.append(ops.Identity())  # a changed Sequential is a new fuser: first call again
    seq(x.requires_grad_())
    assert log[:4] == [("a", "first"), ("b", "first"), ("a", "pre", True), ("b", "pre", True)]


def test_hooks_on_standalone_and_fuser_calls():
    log = []
    a = Shift(log, "a")
    a(torch.randn(2, dtype=D))
    a(torch.randn(2, dtype=D))
    assert [e for e in log if e[1] != "forward"] == [
        ("a", "first"),
        ("a", "pre", False),
        ("a", "pre", False),
    ]
    log.clear()
    fuser = ops.OperationFuser([a])
    fuser(torch.randn(2, dtype=D, requires_grad=True))
    assert [e for e in log if e[1] != "forward"] == [("a", "first"), ("a", "pre", True)]


def test_fusion_functions_see_recipe_objects_and_fused_faces():
    seen = []

    def spy(ops_list, *, recipe):
        seen.append((recipe, [type(op).__name__ for op in ops_list], ops_list))
        return ops_list

    assert ops.register_forward_fusion(spy) is None  # te.ops' functions return None
    lin = ops.Linear(16, 16, device="cpu", dtype=torch.float32)
    seq = ops.Sequential(lin, ops.GELU())
    x = torch.randn(16, 16)
    seq(x)
    rec, names, ops_list = seen[-1]
    assert rec is None
    assert names == ["ForwardLinearBiasActivation"]  # a built-in fusion ran first
    assert [type(b).__name__ for b in ops_list[0].basic_ops] == ["BasicLinear", "Bias", "GELU"]
    assert ops_list[0].basic_ops[0] is lin.basic_ops[0]
    r = recipe.Float8CurrentScaling()
    with fusible.autocast(recipe=r):
        seq(x)
    assert seen[-1][0] is r  # the plan was rebuilt for the recipe and got the object itself

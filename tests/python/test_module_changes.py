"""Changes after construction take effect or are refused: every route of replacing or removing a
child of a Sequential regroups it (eager and compiled), and an op's hyperparameters (what its
constructor set) are read-only, with an error naming the op and the attribute."""

import fusible  # noqa: F401
import pytest
import torch
import torch.nn.functional as F
from fusible import ops
from op_specs import GROUPED_SPECS, SPECS

D = torch.float64


def _model():
    torch.manual_seed(0)
    lin = ops.Linear(16, 16, device="cpu", dtype=D)
    with torch.no_grad():
        lin.bias.normal_()
    return ops.Sequential(lin, ops.ReLU())


def _route_setattr(s):
    setattr(s, "1", ops.SiLU())
    return lambda h: F.silu(h)


def _route_register_module(s):
    s.register_module("1", ops.SiLU())
    return lambda h: F.silu(h)


def _route_add_module(s):
    s.add_module("1", ops.SiLU())
    return lambda h: F.silu(h)


def _route_setitem(s):
    s[1] = ops.SiLU()
    return lambda h: F.silu(h)


def _route_delattr(s):
    delattr(s, "1")
    return lambda h: h


def _route_delitem(s):
    del s[1]
    return lambda h: h


def _route_append(s):
    s.append(ops.ConstantScale(3.0))
    return lambda h: 3.0 * F.relu(h)


def _route_insert(s):
    s.insert(1, ops.ConstantScale(-1.0))
    return lambda h: F.relu(-h)


def _route_pop(s):
    s.pop(1)
    return lambda h: h


def _route_setattr_new_name(s):
    setattr(s, "tail", ops.ConstantScale(2.0))  # a new child goes last, as in torch.nn
    return lambda h: 2.0 * F.relu(h)


ROUTES = [
    _route_setattr,
    _route_register_module,
    _route_add_module,
    _route_setitem,
    _route_delattr,
    _route_delitem,
    _route_append,
    _route_insert,
    _route_pop,
    _route_setattr_new_name,
]


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.__name__[len("_route_") :])
@pytest.mark.parametrize("compiled", [False, True])
def test_replacing_a_child_after_a_call_takes_effect(route, compiled):
    torch._dynamo.reset()
    s = _model()
    run = torch.compile(s, backend="aot_eager", fullgraph=True) if compiled else s
    x = torch.randn(4, 16, dtype=D, requires_grad=True)
    lin = s[0]
    torch.testing.assert_close(run(x), F.relu(F.linear(x, lin.weight, lin.bias)))
    after = route(s)
    y = run(x)
    want = after(F.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (want_gx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(gx, want_gx)
    assert len(s.fusion_plan()) >= 1


def _all_ops():
    for spec in SPECS + GROUPED_SPECS:
        yield spec.name, spec.make("cpu", torch.float32)
    yield "Linear", ops.Linear(8, 4, device="cpu")
    yield "Quantize", ops.Quantize(forward=True, backward=True)
    yield "Dropout", ops.Dropout(0.1)


@pytest.mark.parametrize("name,op", list(_all_ops()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_hyperparameter_is_read_only(name, op):
    frozen = op._frozen
    for field in getattr(type(op), "_repr_fields", ()):  # what repr shows is among them
        if field in op.__dict__:
            assert field in frozen, (name, field)
    for field in frozen:
        before = getattr(op, field)
        with pytest.raises(AttributeError, match=rf"{type(op).__name__}\.{field} is fixed"):
            setattr(op, field, before)
        with pytest.raises(AttributeError, match=rf"{type(op).__name__}\.{field} is fixed"):
            delattr(op, field)
        assert getattr(op, field) is before  # left as it was
    op.a_users_own_attribute = 1  # new attributes stay writable
    assert op.a_users_own_attribute == 1
    op.train(False)  # and nn.Module's own
    assert not op.training


def test_named_hyperparameters_are_among_them():
    assert {"eps", "normalized_shape", "zero_centered_gamma"} <= ops.LayerNorm(8)._frozen
    assert "p" in ops.Dropout(0.1)._frozen
    assert "scale" in ops.ConstantScale(2.0)._frozen
    with pytest.raises(AttributeError, match="build a new Dropout"):
        ops.Dropout(0.1).p = 0.0
    # te.ops' private names, which te.ops code writes and te.ops reads per call: refused alike.
    assert "_cache_quantized_input" in ops.GELU()._frozen
    grouped = ops.GroupedLinear(2, 4, 4, device="cpu")
    assert {"_accumulate_into_main_grad", "_scale_bias"} <= grouped._frozen
    assert {"_quantize_forward", "_quantize_backward"} <= ops.Quantize()._frozen
    assert "_has_bias" in ops.Linear(4, 4, device="cpu")._frozen
    with pytest.raises(AttributeError, match="GELU._cache_quantized_input is fixed"):
        ops.GELU()._cache_quantized_input = True


def test_a_users_subclass_keeps_its_own_attributes_writable():
    class Scaled(ops.ConstantScale):
        def __init__(self):
            super().__init__(2.0)
            self.tag = "mine"

    m = Scaled()
    m.tag = "changed"
    assert m.tag == "changed"
    with pytest.raises(AttributeError, match="Scaled.scale is fixed"):
        m.scale = 3.0


def test_a_wrong_keyword_names_the_op():
    with pytest.raises(TypeError, match=r"GELU\.__init__\(\) got an unexpected keyword argument"):
        ops.GELU(approximate="none")
    with pytest.raises(TypeError, match=r"SwiGLU\.__init__\(\) got an unexpected keyword"):
        ops.SwiGLU(limit=1.0)


def test_a_parameter_slot_keeps_what_the_op_was_built_with():
    # A bias assigned to Linear(bias=False) would be held but never added: refused instead, as is
    # removing one (assigning None); the op keeps computing as before. ValueError, as te.ops'.
    lin = ops.Linear(4, 3, bias=False, device="cpu", dtype=D)
    with pytest.raises(ValueError, match="built without parameter 'bias'"):
        lin.bias = torch.nn.Parameter(torch.randn(3, dtype=D))
    assert lin.bias is None
    x = torch.randn(2, 4, dtype=D)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    for op in (ops.Linear(4, 3, device="cpu", dtype=D), ops.LayerNorm(4, device="cpu", dtype=D)):
        bias = op.bias
        with pytest.raises(ValueError, match="cannot remove parameter 'bias'"):
            op.bias = None
        assert op.bias is bias


@pytest.mark.parametrize("in_sequential", [False, True])
def test_writing_training_switches_dropout(in_sequential):
    # `m.training = False`, as a loop over modules() does, not only m.eval().
    drop = ops.Dropout(0.5)
    model = ops.Sequential(drop) if in_sequential else drop
    x = torch.ones(4096, dtype=D)
    drop.training = False
    assert torch.equal(model(x), x)
    drop.training = True
    assert (model(x) == 0).any()


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.__setitem__(1, F.relu),
        lambda s: s.__setitem__(0, 5),
        lambda s: s.__setitem__(5, ops.ReLU()),
        lambda s: s.insert(1, "relu"),
    ],
)
def test_a_refused_list_change_leaves_the_sequential_as_it_was(change):
    s = _model()
    children = list(s)
    x = torch.randn(3, 16, dtype=D)
    before = s(x)
    with pytest.raises((TypeError, IndexError)):
        change(s)
    assert list(s) == children
    torch.testing.assert_close(s(x), before)


def test_setitem_keeps_the_childrens_names():
    # As torch.nn.Sequential: the new module takes the old one's key (checkpoints keep their keys).
    from collections import OrderedDict

    s = ops.Sequential(
        OrderedDict(fc1=ops.Linear(8, 8, device="cpu", dtype=D), act=ops.GELU(), fc2=ops.ReLU())
    )
    s[1] = ops.SiLU()
    assert list(s._modules) == ["fc1", "act", "fc2"] and isinstance(s.act, ops.SiLU)
    x = torch.randn(2, 8, dtype=D)
    torch.testing.assert_close(s(x), F.relu(F.silu(s.fc1(x))))


@pytest.mark.parametrize("make", [ops.LayerNorm, ops.RMSNorm])
@pytest.mark.parametrize("eps", [-1e-3, float("nan"), float("inf")])
def test_a_norm_refuses_an_eps_that_is_negative_or_not_finite(make, eps):
    with pytest.raises(ValueError, match=f"{make.__name__}: expected eps >= 0"):
        make(4, eps=eps, device="cpu")
    with pytest.raises(ValueError, match="L2Normalization: expected eps >= 0"):
        ops.L2Normalization(eps=eps)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: ops.Linear(4.9, 3, device="cpu"), "Linear: in_features"),
        (lambda: ops.BasicLinear(4, 2.5, device="cpu"), "BasicLinear: out_features"),
        (lambda: ops.GroupedLinear(2.0, 4, 3, device="cpu"), "GroupedLinear: num_groups"),
        (lambda: ops.LayerNorm(4.5, device="cpu"), "LayerNorm: normalized_shape"),
        (lambda: ops.RMSNorm([4, 2.0], device="cpu"), "RMSNorm: normalized_shape"),
        (lambda: ops.Bias(3.2, device="cpu"), "Bias: size"),
        (lambda: ops.Reshape((2.5, 4)), "Reshape: shape"),
    ],
)
def test_a_size_that_is_not_an_int_is_refused_not_truncated(make, name):
    # torch.nn.Linear(4.9, 3) fails too; truncating to 4 built a model of another shape.
    with pytest.raises(TypeError, match=f"{name} must be an int, got float"):
        make()


def test_sizes_take_any_integer_type():
    import numpy as np

    lin = ops.Linear(np.int64(4), torch.tensor(3), device="cpu")
    assert (lin.in_features, lin.out_features) == (4, 3)
    assert type(lin.in_features) is int and lin.weight.shape == (3, 4)
    assert ops.LayerNorm(torch.Size([4]), device="cpu").normalized_shape == (4,)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_repr_says_whether_it_has_a_bias(bias):
    assert repr(ops.GroupedLinear(2, 4, 3, bias=bias, device="cpu")) == (
        f"GroupedLinear(num_groups=2, in_features=4, out_features=3, bias={bias})"
    )

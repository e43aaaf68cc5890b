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

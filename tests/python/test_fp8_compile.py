"""FP8 inside torch.compile(fullgraph=True): a compiled Sequential under fusible.autocast computes
what the eager one does (forward, every gradient, the parameters and the delayed-scaling state
after several optimizer steps), though its backward recomputes the forward outside the autocast;
another recipe compiles another graph; what it cannot honour is refused."""

import copy

import fusible
import pytest
import torch
from conftest import DEVICES
from fusible import ops, recipe

RECIPES = {
    "current": recipe.Float8CurrentScaling,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "block": recipe.Float8BlockScaling,
}


def mlp(device):
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(64, device=device),
        ops.Linear(64, 128, device=device),
        ops.GELU(),
        ops.Linear(128, 64, device=device),
    )
    with torch.no_grad():
        for p in model.parameters():  # every parameter random and nonzero, biases included
            p.copy_(torch.randn_like(p) * 0.2 + 0.05)
    return model


def step(model, x, g, rec):
    """One forward (under rec, None: no autocast) and backward; returns y, x's gradient, the
    parameter gradients, and applies an SGD step."""
    x = x.detach().clone().requires_grad_()
    with fusible.autocast(enabled=rec is not None, recipe=rec):
        y = model(x)
    (y * g).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
            p.grad = None
    return [y.detach(), x.grad, *grads]


def fp8_states(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}


def assert_same_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is None:
            continue
        for op_a, op_b in zip(a[k]["ops"], b[k]["ops"], strict=True):
            assert (op_a is None) == (op_b is None), k
            for d in ("forward", "backward") if op_a is not None else ():
                for (ha, sa), (hb, sb) in zip(op_a[d], op_b[d], strict=True):
                    torch.testing.assert_close(ha, hb, rtol=0, atol=0)
                    torch.testing.assert_close(sa, sb, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(RECIPES))
def test_compiled_fp8_trains_as_eager(device, kind):
    torch._dynamo.reset()
    eager = mlp(device)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    rec = RECIPES[kind]()
    unquantized = mlp(device)
    for i in range(3):
        x = torch.randn(32, 64, device=device)
        g = torch.randn(32, 64, device=device)
        want = step(eager, x, g, rec)
        got = step(compiled, x, g, rec)
        plain = step(unquantized, x, g, None)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        if i == 0:  # FP8 was on in both: the result is not the unquantized one
            assert not torch.allclose(got[0], plain[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(compiled_model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Delayed scaling: each history advanced once per step in each direction, as in eager.
    assert_same_states(fp8_states(compiled_model), fp8_states(eager))


def test_another_recipe_compiles_another_graph():
    torch._dynamo.reset()
    eager = mlp("cpu")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 64)
    for rec in (recipe.Float8CurrentScaling(), None, recipe.Float8BlockScaling()):
        with fusible.autocast(enabled=rec is not None, recipe=rec):
            torch.testing.assert_close(compiled(x), eager(x), rtol=0, atol=0)


def test_a_call_under_another_recipe_than_compiled_is_refused():
    # What Dynamo's guard prevents, checked again by the op itself (e.g. another thread's autocast).
    model = mlp("cpu")
    params = [p.detach() for p in model.parameters()]
    x = torch.randn(4, 64)
    handle = model._compile_handle
    model(x)  # builds the engine
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        with pytest.raises(RuntimeError, match="compiled under FP8 recipe '' but called under"):
            torch.ops.fusible.sequential_call(handle, [x, *params], 0, 0, "", "")
    key = fusible.quantization._compiled_key
    assert key == ""  # restored on exit
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        key = fusible.quantization._compiled_key
    with pytest.raises(RuntimeError, match="compiled under FP8 recipe 'current;"):
        torch.ops.fusible.sequential_call(handle, [x, *params], 0, 0, "", key)


def test_fp8_weights_under_compile_are_refused():
    torch._dynamo.reset()
    with fusible.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        model = ops.Sequential(ops.Linear(64, 64, device="cpu"), ops.GELU())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="FP8 weights .* under torch.compile are not supported"):
        with fusible.autocast():
            compiled(torch.randn(16, 64))

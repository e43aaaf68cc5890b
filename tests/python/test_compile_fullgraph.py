"""torch.compile(fullgraph=True) of a fusible Sequential: the call is one custom op
(fusible::sequential_call), so the graph has no break, and compiled forward and backward equal
eager: with channels, extra outputs to the caller, channel inputs, a non-fusible module between
groups, and a model with no parameters that need gradients."""

import copy

import pytest
import torch
from conftest import DEVICES
from fusible import ops

D = torch.float64


def _model(device):
    torch.manual_seed(0)
    make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
    make.set_extra_output_channel(0, "residual", output_to_caller=False)
    add.set_extra_input_channel(0, "residual")
    extra = ops.MakeExtraOutput()  # its copy goes back to the caller
    gate = ops.AddExtraInput()
    gate.set_extra_input_channel(0, "gate")  # fed by channel_inputs
    return ops.Sequential(
        make,
        ops.LayerNorm(8, dtype=D, device=device),
        ops.Linear(8, 16, dtype=D, device=device),
        ops.GELU(),
        torch.nn.Tanh(),  # a plain module between two fuser groups
        ops.Linear(16, 8, dtype=D, device=device),
        add,
        extra,
        gate,
    )


def _run(model, x, gate):
    y, side = model(x, channel_inputs={"gate": gate})
    return y, side


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_equals_eager(device, backend):
    torch._dynamo.reset()
    model = _model(device)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, 8, dtype=D, device=device, requires_grad=True)
    gate = torch.randn(4, 8, dtype=D, device=device, requires_grad=True)
    x_ref, gate_ref = (t.detach().clone().requires_grad_() for t in (x, gate))
    out, out_ref = _run(compiled, x, gate), _run(ref, x_ref, gate_ref)
    for a, b in zip(out, out_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (out[0].square().sum() + out[1].sum()).backward()
    (out_ref[0].square().sum() + out_ref[1].sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gate.grad, gate_ref.grad, rtol=1e-12, atol=1e-12)
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)


def test_no_graph_break():
    torch._dynamo.reset()
    model = _model("cpu")
    x, gate = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    explained = torch._dynamo.explain(model)(x, channel_inputs={"gate": gate})
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_inference_and_frozen_parameters():
    torch._dynamo.reset()
    model = _model("cpu")
    for p in model.parameters():
        p.requires_grad_(False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, gate = torch.randn(4, 8, dtype=D, requires_grad=True), torch.randn(4, 8, dtype=D)
    y, _ = _run(compiled, x, gate)
    y.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    _run(model, x_ref, gate)[0].sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(_run(compiled, x, gate)[0], _run(model, x, gate)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", ["fusible", "torch.nn between groups"])
def test_training_dropout_replays_its_masks_in_the_backward(device, dropout):
    """The compiled backward recomputes the call from the generator state the forward started
    from: forward, gradients and the parameters after 3 steps equal eager's with the same seeds,
    and the backward leaves the random sequence as it was."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    drop = ops.Dropout(0.5) if dropout == "fusible" else torch.nn.Dropout(0.5)
    model = ops.Sequential(
        ops.Linear(8, 8, dtype=D, device=device), drop, ops.Linear(8, 8, dtype=D, device=device)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for step in range(3):
        x = torch.randn(16, 8, dtype=D, device=device)
        results = []
        for m in (model, compiled):
            xi = x.clone().requires_grad_()
            torch.manual_seed(100 + step)
            y = m(xi)
            state = torch.get_rng_state(), _cuda_rng(device)
            y.square().sum().backward()
            assert torch.equal(state[0], torch.get_rng_state())
            assert torch.equal(state[1], _cuda_rng(device))
            results.append([y, xi.grad, *(p.grad for p in m.parameters())])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(results[0][0], model[2](model[0](x)))  # a mask was applied
        with torch.no_grad():
            for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _cuda_rng(device):
    return torch.cuda.get_rng_state() if device == "cuda" else torch.empty(0)


@pytest.mark.parametrize("op", [ops.AddExtraInput, ops.MakeExtraOutput])
def test_in_place_extra_ops_are_refused(op):
    """In place, they write into a tensor the custom op was given (undeclared mutation)."""
    torch._dynamo.reset()
    model = ops.Sequential(ops.Linear(8, 8, dtype=D, device="cpu"), op(in_place=True))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 8, dtype=D, requires_grad=True)
    args = (x, torch.randn(2, 8, dtype=D)) if op is ops.AddExtraInput else (x,)
    with pytest.raises(Exception, match=r"\(in_place=True\) under torch.compile"):
        compiled(*args)


def test_forward_hooks_on_inner_ops_are_refused_with_a_clear_error():
    torch._dynamo.reset()
    model = _model("cpu")
    model[2].register_forward_hook(lambda m, i, o: o * 2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="hooks on ops inside a Sequential under"):
        _run(compiled, torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D))


def test_backward_hooks_on_inner_ops_are_refused_with_a_clear_error():
    # Eager runs them (the op unfused); a compiled Sequential is one call that cannot.
    torch._dynamo.reset()
    model = _model("cpu")
    model[2].register_full_backward_hook(lambda m, gi, go: None)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="hooks on ops inside a Sequential under"):
        _run(compiled, torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D))


def test_a_hook_added_after_compiling_is_seen_with_dynamo_hook_guards():
    # As for any module under torch.compile: Dynamo skips guards on hooks by default; with them on,
    # a hook added to an inner op after compiling recompiles, and is refused there.
    torch._dynamo.reset()
    model = _model("cpu")
    x, gate = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        ref = _run(compiled, x, gate)[0]
        handle = model[2].register_forward_hook(lambda m, i, o: o * 2)
        with pytest.raises(Exception, match="hooks on ops inside a Sequential under"):
            _run(compiled, x, gate)
        handle.remove()
        torch.testing.assert_close(_run(compiled, x, gate)[0], ref)


def test_the_engine_is_found_again_after_the_sequential_changed():
    # The compiled call finds the C++ engine by handle; a list change rebuilds the engine.
    torch._dynamo.reset()
    model = _model("cpu")
    x, gate = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ref = _run(compiled, x, gate)[0]
    model.append(ops.ConstantScale(2.0))  # a stale engine would give ref, not 2 * ref
    torch.testing.assert_close(_run(compiled, x, gate)[0], 2 * ref)
    torch.testing.assert_close(_run(model, x, gate)[0], 2 * ref)


def test_opcheck_of_the_call_ops():
    model = _model("cpu")
    from fusible.ops import _compile_support as cs

    x, gate = torch.randn(4, 8, dtype=D), torch.randn(4, 8, dtype=D)
    paths = cs._param_paths(model._compile_handle)
    params = [getattr(model.get_submodule(p), n).detach() for p, n in paths]
    args = (model._compile_handle, [x, gate, *params], 0, 1, "gate")
    torch.library.opcheck(torch.ops.fusible.sequential_call.default, args)
    outs = torch.ops.fusible.sequential_call(*args)
    grads = [torch.randn_like(o) for o in outs]
    torch.library.opcheck(torch.ops.fusible.sequential_call_backward.default, (*args, grads))


def test_a_module_with_parameters_between_groups_is_refused():
    torch._dynamo.reset()
    model = ops.Sequential(
        ops.Linear(8, 8, dtype=D, device="cpu"),
        torch.nn.Linear(8, 8, dtype=D),
        ops.GELU(),
    )
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="with parameters between fuser groups under"):
        compiled(torch.randn(2, 8, dtype=D, requires_grad=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_reduce_overhead_mode_equals_eager():
    """mode="reduce-overhead" replays CUDA graphs of the compiled forward and backward; several
    steps with fresh inputs equal eager."""
    torch._dynamo.reset()
    model = _model("cuda")
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        x = torch.randn(4, 8, dtype=D, device="cuda", requires_grad=True)
        gate = torch.randn(4, 8, dtype=D, device="cuda", requires_grad=True)
        x_ref, gate_ref = (t.detach().clone().requires_grad_() for t in (x, gate))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out, out_ref = _run(compiled, x, gate), _run(ref, x_ref, gate_ref)
        for a, b in zip(out, out_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        (out[0].square().sum() + out[1].sum()).backward()
        (out_ref[0].square().sum() + out_ref[1].sum()).backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=n)


@pytest.mark.parametrize("single", [False, True])
def test_jit_trace_records_one_op_and_differentiates_it(single):
    torch.manual_seed(0)
    model = ops.Linear(8, 8, dtype=D, device="cpu")
    with torch.no_grad():
        model.bias.normal_()
    if not single:
        model = ops.Sequential(model, ops.GELU(), ops.Linear(8, 4, dtype=D, device="cpu"))
    x = torch.randn(3, 8, dtype=D)
    traced = torch.jit.trace(model, (x,))  # with its default check: the same graph each run
    assert "fusible::sequential_call" in str(traced.graph)
    traced(x).square().sum().backward()  # the parameters get their gradients through the trace
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    for a, b in zip(want, model.parameters(), strict=True):
        torch.testing.assert_close(a, b.grad, rtol=0, atol=0)
    for batch in (3, 5):
        xa = torch.randn(batch, 8, dtype=D, requires_grad=True)
        xb = xa.detach().clone().requires_grad_()
        ya, yb = traced(xa), model(xb)
        torch.testing.assert_close(ya, yb, rtol=0, atol=0)
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_call_runs_under_the_traced_torch_autocast(device):
    """A compiled graph runs its autocast regions as explicit casts; the call must still compute
    in the autocast dtype, as the eager call does: same outputs and the same training over 3 SGD
    steps. Without autocast the same compiled model computes in float32 (another graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ops.Sequential(
        ops.LayerNorm(32, device=device),
        ops.Linear(32, 64, device=device),
        ops.GELU(),
        ops.Linear(64, 32, device=device),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)  # biases and norm parameters not at their init
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 32, device=device)
    for _ in range(3):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            y, y_ref = compiled(x), ref(x)
        assert y.dtype == y_ref.dtype == torch.bfloat16
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        y.float().square().mean().backward()
        y_ref.float().square().mean().backward()
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1.6e-2, atol=1e-5, msg=name)
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    y = compiled(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_two_calls_on_the_same_input_are_not_merged(device, backend):
    """R-Drop's pattern: one Sequential called twice on the same tensor inside a compiled function.
    The calls draw different Dropout masks, as in eager (a graph pass merging the two identical
    calls would return one result twice); outputs and gradients equal eager's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(8, 8, dtype=D, device=device), ops.Dropout(0.5))

    def twice(x):
        return model(x), model(x)

    compiled = torch.compile(twice, backend=backend, fullgraph=True)
    x = torch.randn(16, 8, dtype=D, device=device)
    results = []
    for f in (twice, compiled):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        a, b = f(xi)
        (a.square().sum() + 2 * b.sum()).backward()
        results.append([a, b, xi.grad, *(p.grad.clone() for p in model.parameters())])
        model.zero_grad(set_to_none=True)
    assert not torch.equal(results[1][0], results[1][1])
    for u, v in zip(*results, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


_FALLBACKS_CHECK = """
import sys, torch
{first}
import torch._inductor.lowering as L
from fusible import _inductor_fallbacks
ops = _inductor_fallbacks.fusible_overloads()
assert len(ops) > 20, len(ops)
missing = [str(op) for op in ops if op not in L.lowerings]
assert not missing, missing
# The layout constraint Inductor's implicit fallback gives a custom op (its default tag's).
op = torch.ops.fusible.cross_entropy_fwd.default
implicit = L.tag_to_layout_constraint(L.get_layout_constraint_tag(op, with_default=True))
assert implicit is not None and L.maybe_layout_constraints(op) is implicit, implicit
print("ok", len(ops))
"""


@pytest.mark.parametrize("order", ["fusible_first", "inductor_first"])
def test_every_fusible_op_is_an_inductor_fallback_once_inductor_loads(order):
    # In a fresh process: fusible imported before Inductor's lowering module (the finder
    # registers the ops when it loads) and after it (registered at fusible's import).
    import subprocess
    import sys

    first = (
        "import fusible\nassert 'torch._inductor.lowering' not in sys.modules"
        if order == "fusible_first"
        else "import torch._inductor.lowering\nimport fusible"
    )
    run = subprocess.run(
        [sys.executable, "-c", _FALLBACKS_CHECK.format(first=first)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok"), run.stdout


def test_inductor_never_takes_its_implicit_fallback_path_for_fusible_ops(monkeypatch):
    # That path formats each argument's whole IR (exponential in the depth of a chain of
    # fallback kernels: a loss after many layers took minutes); fusible's ops skip it.
    import fusible
    from torch._inductor import exc

    seen = []
    original = exc.OperatorIssue.operator_str

    def record(target, args, kwargs):
        seen.append(str(target))
        return original(target, args, kwargs)

    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(record))
    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [
        ops.Sequential(ops.RMSNorm(16, device="cpu"), ops.Linear(16, 16, device="cpu"), ops.GELU())
        for _ in range(3)
    ]

    def loss(x, targets):
        for block in blocks:
            x = block(x) + x
        return fusible.functional.cross_entropy(x, targets)

    x = torch.randn(8, 16, requires_grad=True)
    targets = torch.randint(16, (8,))
    compiled = torch.compile(loss, backend="inductor", fullgraph=True)
    out = compiled(x, targets)
    out.backward()
    x_ref = x.detach().clone().requires_grad_()
    ref = loss(x_ref, targets)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert not [t for t in seen if "fusible" in t], seen

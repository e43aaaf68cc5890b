"""Dynamic shapes: torch.compile(dynamic=True) and mark_dynamic give one graph for every batch and
sequence size, torch.export with Dim on batch and sequence runs at other sizes, and an
AOTInductor package of a fusible model runs; each against the eager model."""

import os
import shutil

import fusible  # noqa: F401
import pytest
import torch
from conftest import DEVICES
from fusible import ops
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

H = 16


def _block(device):
    """LayerNorm -> MLP -> residual add through a channel, then a reshape of the leading dims."""
    torch.manual_seed(0)
    residual = ops.MakeExtraOutput()
    residual.set_extra_output_channel(0, "res", output_to_caller=False)
    add = ops.AddExtraInput()
    add.set_extra_input_channel(0, "res")
    seq = ops.Sequential(
        residual,
        ops.LayerNorm(H, device=device),
        ops.Linear(H, 4 * H, device=device),
        ops.GELU(),
        ops.Linear(4 * H, H, device=device),
        add,
        ops.Reshape((-1, H)),
    )
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 0.05)
    return seq


def _check(run, model, x, mark_dynamic=False):
    xa = x.clone().requires_grad_()
    xb = x.clone().requires_grad_()
    if mark_dynamic:  # on the tensor the compiled model gets (a clone does not keep the marks)
        torch._dynamo.mark_dynamic(xa, 0)
        torch._dynamo.mark_dynamic(xa, 1)
    ya, yb = run(xa), model(xb)
    assert ya.shape == (x.shape[0] * x.shape[1], H)
    torch.testing.assert_close(ya, yb)
    g = torch.randn_like(yb)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(xa.grad, xb.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_one_graph_for_every_batch_and_sequence_size(device, how):
    torch._dynamo.reset()
    model = _block(device)
    counter = CompileCounterWithBackend("aot_eager")
    dynamic = True if how == "dynamic=True" else None  # None: mark_dynamic decides
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    sizes = [(b, t) for t in (3, 7, 12) for b in range(2, 12)]  # 10 batch x 3 sequence sizes
    for b, t in sizes:
        _check(compiled, model, torch.randn(b, t, H, device=device), how == "mark_dynamic")
    assert counter.frame_count == 1, counter.frame_count


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_public_extra_tensors_and_a_new_row_count_after_the_first_call(backend):
    """dynamic=None: the first call compiles static, a second row count recompiles dynamic. A
    replay of the graph handed the fake call tensors whose sizes were symbolic in C++ (it
    raised "Cannot call numel() on tensor with symbolic sizes")."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = ops.Sequential(
        ops.Linear(H, H, device="cpu"),
        ops.MakeExtraOutput(),
        ops.GELU(),
        ops.Linear(H, H, device="cpu"),
        ops.AddExtraInput(),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 0.05)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for rows in (4, 6, 9):
        x, r = torch.randn(rows, H), torch.randn(rows, H)
        xa, ra = x.clone().requires_grad_(), r.clone().requires_grad_()
        xb, rb = x.clone().requires_grad_(), r.clone().requires_grad_()
        got, want = compiled(xa, ra), model(xb, rb)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        sum(t.sum() for t in got).backward()
        sum(t.sum() for t in want).backward()
        torch.testing.assert_close(xa.grad, xb.grad)
        torch.testing.assert_close(ra.grad, rb.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_export_with_dynamic_batch_and_sequence(device):
    model = _block(device)
    x = torch.randn(4, 6, H, device=device)
    b, t = Dim("b", min=2, max=64), Dim("t", min=2, max=512)
    ep = torch.export.export(model, (x,), dynamic_shapes={"input": {0: b, 1: t}})
    run = ep.module()
    for shape in [(3, 5), (8, 2), (2, 33)]:
        _check(run, model, torch.randn(*shape, H, device=device))


def test_exporting_a_fixed_feature_size_as_dynamic_is_refused():
    model = _block("cpu")
    x = torch.randn(4, 6, H)
    with pytest.raises(Exception, match="(?i)constraint|specializ"):
        torch.export.export(model, (x,), dynamic_shapes={"input": {2: Dim("h")}})


@pytest.mark.skipif(shutil.which("g++") is None, reason="AOTInductor needs a C++ compiler (g++)")
@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_runs(device, tmp_path):
    model = _block(device)
    x = torch.randn(4, 6, H, device=device)
    b = Dim("b", min=2, max=64)
    ep = torch.export.export(model, (x,), dynamic_shapes={"input": {0: b}})
    path = torch._inductor.aoti_compile_and_package(
        ep, package_path=os.fspath(tmp_path / "model.pt2")
    )
    run = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for batch in (4, 9):
            x = torch.randn(batch, 6, H, device=device)
            y = run(x)
            assert y is not None
            torch.testing.assert_close(y, model(x))

"""Graph safety on CUDA (issue 12): a fusible model's forward and forward+backward make no host
synchronization (torch.cuda.set_sync_debug_mode("error") turns one into an error), and capture
into a CUDA graph replays to what eager computes. Skipped without CUDA."""

import pytest
import torch
from conftest import HAS_CUDA, randomized
from fusible import ops

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")

D = torch.float32


def _model(dropout=0.0, dtype=D):
    """dtype: the parameters'. With bf16 ones and a float32 input, the norm reads the float32
    stream and writes its float32 gradient itself (plus the residual's)."""
    torch.manual_seed(0)
    make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
    make.set_extra_output_channel(0, "residual", output_to_caller=False)
    add.set_extra_input_channel(0, "residual")
    model = ops.Sequential(
        make,
        ops.LayerNorm(64, device="cuda", dtype=dtype),
        ops.Linear(64, 256, device="cuda", dtype=dtype),
        ops.GELU(),
        ops.Dropout(dropout),
        ops.Linear(256, 64, device="cuda", dtype=dtype),
        add,
    )
    return randomized(model)  # norm and biases too (the same draws for every call: seeded)


@pytest.mark.parametrize("dtype", [D, torch.bfloat16])
def test_no_host_synchronization(dtype):
    model = _model(dropout=0.1, dtype=dtype)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    model(x).sum().backward()  # first call: plans, heuristics, materialization
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            model(x)
        model(x).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_forward_graph_replays_eager():
    model = _model()
    static_x = torch.randn(32, 64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = model(static_x)
    static_x.copy_(torch.randn_like(static_x))
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(static_y, model(static_x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [D, torch.bfloat16])
def test_make_graphed_callables_forward_backward(dtype):
    model, ref = _model(dtype=dtype), _model(dtype=dtype)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    for _ in range(2):
        xs = torch.randn(32, 64, device="cuda", requires_grad=True)
        xr = xs.detach().clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        graphed(xs).square().sum().backward()
        ref(xr).square().sum().backward()
        torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_dropout_in_a_graph_draws_fresh_masks():
    """Dropout's Philox seed and offset come from the CUDA generator's graph-safe state: each
    replay draws a new mask, and every output element is 0 or x / (1 - p)."""
    p = 0.5
    model = ops.Sequential(ops.Dropout(p))
    static_x = torch.rand(4096, device="cuda", dtype=D) + 1.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
    masks = []
    for _ in range(2):
        graph.replay()
        kept = static_y != 0
        torch.testing.assert_close(static_y[kept], static_x[kept] / (1 - p), rtol=1e-6, atol=0)
        assert 0.4 < kept.float().mean().item() < 0.6
        masks.append(kept.clone())
    assert not torch.equal(masks[0], masks[1]), "two replays drew the same mask"

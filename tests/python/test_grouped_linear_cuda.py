"""GroupedLinear on CUDA (issue 15): the split sizes never reach the host (no synchronization, so
a forward + backward can be captured in a CUDA graph and replayed with new split values), and bad
split values trip a device-side assert naming the op."""

import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_close_to_ref, cuda_only
from fusible import ops

pytestmark = cuda_only
D = torch.float64


def _op(dtype, seed=0, **kw):
    torch.manual_seed(seed)
    op = ops.GroupedLinear(4, 64, 32, scale_bias=True, device="cuda", dtype=dtype, **kw)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return op


def _run(op, x, sizes, s, dy):
    """y and every gradient of one forward + backward."""
    x, s = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    for p in op.parameters():
        p.grad = None
    y = op(x, sizes, s)
    y.backward(dy)
    return [y, x.grad, s.grad] + [p.grad for p in op.parameters()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_and_backward_never_synchronize_with_the_host(dtype, index_dtype):
    op = _op(dtype)
    sizes = torch.tensor([10, 0, 30, 24], dtype=index_dtype, device="cuda")
    x = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
    s = torch.rand(64, device="cuda", dtype=dtype, requires_grad=True)
    op(x, sizes, s).sum().backward()  # first call: plans and caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call now raises
    try:
        y = op(x, sizes, s)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert x.grad is not None and s.grad is not None


def test_graph_capture_of_forward_and_backward_replays_new_split_sizes():
    dtype = torch.bfloat16
    op = _op(dtype)
    sizes = torch.tensor([16, 16, 16, 16], device="cuda")
    x = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
    s = torch.rand(64, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 32, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(2):
            _run(op, x, sizes, s, dy)
    torch.cuda.current_stream().wait_stream(side)
    for t in [x, s, *op.parameters()]:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = op(x, sizes, s)
        y.backward(dy)
    captured = lambda: [y, x.grad, s.grad] + [p.grad for p in op.parameters()]  # noqa: E731
    for new in ([40, 0, 4, 20], [0, 64, 0, 0], [16, 16, 16, 16]):
        sizes.copy_(torch.tensor(new))
        graph.replay()
        want = _run(_op(dtype), x, sizes, s, dy)
        for got, ref in zip(captured(), want):
            torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("sizes, message", [([10, -2, 56, 0], "non-negative"), ([10] * 4, "sum")])
def test_bad_split_values_trip_a_device_side_assert_naming_the_op(sizes, message):
    # A device-side assert ends the CUDA context: run it in a process of its own.
    code = textwrap.dedent(
        f"""
        import torch
        from fusible import ops
        op = ops.GroupedLinear(4, 64, 32, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        op(x, torch.tensor({sizes}, device="cuda"))
        torch.cuda.synchronize()
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "fusible GroupedLinear" in out and message in out, out
    assert "device-side assert" in out, out


def test_bad_split_metadata_is_refused_before_any_kernel():
    op = _op(torch.float32)
    x = torch.randn(8, 64, device="cuda")
    with pytest.raises(ValueError, match="int32 or int64"):
        op(x, torch.tensor([2.0, 2, 2, 2], device="cuda"), torch.rand(8, device="cuda"))
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        op(x, torch.tensor([4, 4], device="cuda"), torch.rand(8, device="cuda"))
    y = op(x, torch.tensor([2, 2, 2, 2], device="cuda"), torch.rand(8, device="cuda"))
    assert y.shape == (8, 32)


@pytest.mark.parametrize("in_features", [256, 200])  # 200: bf16 rows not 16-byte multiples
def test_bf16_at_scale_against_float64(in_features):
    torch.manual_seed(8)
    op = ops.GroupedLinear(
        8, in_features, 384, scale_bias=True, device="cuda", dtype=torch.bfloat16
    )
    sizes = torch.tensor([700, 0, 1, 2000, 300, 95, 0, 1000], device="cuda")
    rows = int(sizes.sum())
    # Activation-sized data (0.1): atol 1e-5 also bounds the fp32 accumulation error of a weight
    # gradient summed over 2000 rows where its terms cancel.
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16) * 0.1
    s = torch.rand(rows, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    dy = torch.randn(rows, 384, device="cuda", dtype=torch.bfloat16) * 0.1
    got = _run(op, x, sizes, s, dy)
    split = sizes.tolist()
    xr, sr = (t.detach().double().requires_grad_() for t in (x, s))
    wr = [getattr(op, f"weight{g}").detach().double().requires_grad_() for g in range(8)]
    br = [getattr(op, f"bias{g}").detach().double().requires_grad_() for g in range(8)]
    ref = torch.cat(
        [
            xg @ w.T + sg[:, None] * b
            for xg, sg, w, b in zip(xr.split(split), sr.split(split), wr, br)
        ]
    )
    ref.backward(dy.double())
    want = [ref, xr.grad, sr.grad] + [w.grad for w in wr] + [b.grad for b in br]
    for g, w in zip(got, want):
        assert_close_to_ref(g, w, torch.bfloat16, gemm=True)

"""Dropout's kernels (CPU reference and the CUDA Philox kernel): the keep-mask is bits (element e is
bit e % 8 of byte e / 8), y = x * keep / (1 - p), the backward applies the same mask, the keep rate
is 1 - p, torch.manual_seed reproduces a draw, and (CUDA) a CUDA-graph replay draws fresh masks."""

import pytest
import torch
from conftest import DEVICES, HAS_CUDA, assert_close_to_ref
from fusible import ops

F = torch.ops.fusible


def _unpack(mask, n):
    bits = (mask.long().unsqueeze(-1) >> torch.arange(8, device=mask.device)) & 1
    return bits.reshape(-1)[:n].bool()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (7, 3), (1000, 33)])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.0])
def test_forward_backward_and_mask(device, dtype, shape, p):
    x = (torch.randn(shape, device=device) + 3).to(dtype)  # never 0: dropped means y == 0
    y, mask = F.dropout_fwd(x, p)
    n = x.numel()
    assert mask.dtype == torch.uint8 and mask.shape == ((n + 7) // 8,)
    keep = _unpack(mask, n).view(shape)
    scale = 1 / (1 - p) if p < 1 else 0.0
    assert_close_to_ref(y, x.double() * keep * scale, dtype)
    assert torch.equal(y != 0, keep) or p == 1.0
    dy = torch.randn(shape, device=device).to(dtype)
    assert_close_to_ref(F.dropout_bwd(dy, mask, p), dy.double() * keep * scale, dtype)
    if p == 0.0:
        assert keep.all()
    if p == 1.0:
        assert not keep.any() and not y.any()


@pytest.mark.parametrize("device", DEVICES)
def test_keep_rate_and_seed(device):
    x = torch.ones(1 << 20, device=device)
    torch.manual_seed(5)
    y1, m1 = F.dropout_fwd(x, 0.25)
    torch.manual_seed(5)
    y2, m2 = F.dropout_fwd(x, 0.25)
    _, m3 = F.dropout_fwd(x, 0.25)
    assert torch.equal(m1, m2) and torch.equal(y1, y2)
    assert not torch.equal(m1, m3)
    rate = _unpack(m1, x.numel()).double().mean().item()
    assert abs(rate - 0.75) < 0.005, rate


def test_bad_mask_is_rejected():
    with pytest.raises(RuntimeError, match="dropout_bwd: expected a uint8 bit mask of 2 bytes"):
        F.dropout_bwd(torch.randn(10), torch.zeros(10, dtype=torch.bool), 0.5)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_cuda_graph_replay_draws_new_masks():
    drop = ops.Dropout(0.5)
    x = torch.ones(4096, device="cuda")
    static_y = drop(x)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = drop(x)
    graph.replay()
    first = static_y.clone()
    graph.replay()
    second = static_y.clone()
    assert not torch.equal(first, second)
    for y in (first, second):
        kept = (y != 0).double().mean().item()
        assert 0.45 < kept < 0.55 and torch.all((y == 0) | (y == 2))

"""What a fuser call saves for backward: activations it made are freed op by op during a backward
that does not keep the graph, kept for a second backward with retain_graph=True, and visible to
saved-tensor hooks (activation checkpointing, CPU offload) when hooks are active."""

import pytest
import torch
from conftest import DEVICES
from fusible import ops

D = torch.float64


def _mlp(device):
    torch.manual_seed(0)
    return ops.Sequential(
        ops.LayerNorm(8, device=device, dtype=D),
        ops.Linear(8, 16, device=device, dtype=D),
        ops.GELU(),
        ops.Linear(16, 8, device=device, dtype=D),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_retain_graph_runs_backward_twice(device):
    model = _mlp(device)
    x = torch.randn(5, 8, device=device, dtype=D, requires_grad=True)
    y = model(x)
    (gx1,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    (gx2,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx1, gx2, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(y.sum(), x)


def test_retry_after_a_failed_backward_is_a_clear_error():
    """A backward that fails part-way has freed the activations of the ops it already ran; autograd
    keeps the node, so a retry reaches the fuser again, which refuses it cleanly."""

    class FailOnce(ops.BasicOperation):
        failed = False

        def op_forward(self, ctx, input_, **unused):
            return input_ * 1.0

        def op_backward(self, ctx, grad_output):
            if not self.failed:
                type(self).failed = True
                raise RuntimeError("injected failure")
            return grad_output, []

    model = ops.Sequential(FailOnce(), *_mlp("cpu"))
    x = torch.randn(5, 8, dtype=D, requires_grad=True)
    y = model(x)
    with pytest.raises(RuntimeError, match="injected failure"):
        y.sum().backward()  # the MLP's backwards ran and freed their tensors, then FailOnce raised
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_saved_tensor_hooks_see_the_activations(device):
    model = _mlp(device)
    x = torch.randn(5, 8, device=device, dtype=D, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    # The GELU pre-activation [5, 16] exists only inside the call: the hook still sees it.
    assert (5, 16) in packed, packed
    (g_hooked,) = torch.autograd.grad(y.sum(), x)
    (g_plain,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(g_hooked, g_plain, rtol=0, atol=0)


def test_checkpointed_call_matches_plain():
    model = _mlp("cpu")
    x = torch.randn(5, 8, dtype=D, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    (g_ckpt,) = torch.autograd.grad(y.sum(), x)
    (g_plain,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(g_ckpt, g_plain, rtol=0, atol=0)


def test_input_modified_in_place_after_forward_is_detected():
    model = ops.Sequential(ops.Linear(8, 4, dtype=D, device="cpu"))
    x = torch.randn(3, 8, dtype=D, requires_grad=True)
    h = x * 1  # saved by the linear (its input)
    y = model(h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_python_op_saving_an_outside_tensor_keeps_the_version_check():
    class ScaleByBuffer(ops.BasicOperation):
        def __init__(self):
            super().__init__()
            self.register_buffer("s", torch.full((4,), 2.0, dtype=D))

        def op_forward(self, ctx, input_, **unused):
            ctx.save_for_backward(self.s)
            return input_ * self.s

        def op_backward(self, ctx, grad_output):
            (s,) = ctx.saved_tensors
            return grad_output * s, []

    op = ScaleByBuffer()
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    y = ops.Sequential(op)(x)
    with torch.no_grad():
        op.s.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

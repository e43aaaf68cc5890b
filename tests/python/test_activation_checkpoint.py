"""fusible.checkpoint: an activation checkpoint under an FP8 autocast recomputes as the forward
ran (the forward's recipe; DelayedScaling's forward scales, histories left alone), so training
with it equals training without it, bit for bit, whether the backward runs inside the autocast or
outside it."""

import copy

import fusible
import pytest
import torch
from fusible import ops, recipe

D = torch.float64


def _block():
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.LayerNorm(32, device="cpu", dtype=D),
        ops.Linear(32, 64, device="cpu", dtype=D),
        ops.GELU(),
        ops.Linear(64, 32, device="cpu", dtype=D),
    )
    with torch.no_grad():  # every parameter random: a zero bias hides a wrong bias path
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return seq


def _histories(seq):
    out = []
    for op in seq.modules():
        if isinstance(op, ops.BasicLinear):
            for mode in ("forward", "backward"):
                for i in range(op.num_quantizers(mode)):
                    q = op.get_quantizer(mode, i)
                    out += [q.amax_history.clone(), q.scale.clone()]
    return out


def _train(seq, rec, wrap, backward_inside, steps=3):
    opt = torch.optim.SGD(seq.parameters(), lr=0.05)
    outs = []
    for step in range(steps):
        torch.manual_seed(10 + step)
        x = (torch.randn(16, 32, dtype=D) * (step + 1)).requires_grad_()
        dy = torch.randn(16, 32, dtype=D)
        opt.zero_grad()
        with fusible.autocast(recipe=rec):
            y = wrap(seq, x)
            if backward_inside:
                y.backward(dy)
        if not backward_inside:
            y.backward(dy)
        opt.step()
        outs += [y.detach(), x.grad]
    return outs + [p.detach().clone() for p in seq.parameters()]


def _plain(seq, x):
    return seq(x)


def _checkpointed(seq, x):
    return fusible.checkpoint(seq, x)


@pytest.mark.parametrize("kind", ["delayed", "current", "block"])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_checkpointed_training_equals_plain_training(kind, backward_inside):
    rec = {
        "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
        "current": recipe.Float8CurrentScaling,
        "block": recipe.Float8BlockScaling,
    }[kind]()
    plain, ckpt = _block(), _block()
    want = _train(plain, rec, _plain, backward_inside)
    got = _train(ckpt, rec, _checkpointed, backward_inside)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    if kind == "delayed":  # one history entry per step, as without the checkpoint
        for g, w in zip(_histories(ckpt), _histories(plain), strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


class _Twice(torch.nn.Module):
    """One linear applied twice: its state casts twice per forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = ops.Linear(32, 32, device="cpu", dtype=D)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def _nested_outer(seq, x):
    # The outer recompute runs the inner checkpoint again, under the outer replay.
    return fusible.checkpoint(lambda t: _nested_plain(seq, t), x)


def _nested_plain(seq, x):
    h = seq[1](seq[0](x))
    return fusible.checkpoint(lambda t: seq[3](seq[2](t)), h)


@pytest.mark.parametrize("backward_inside", [False, True])
def test_an_op_cast_twice_and_nested_checkpoints_replay_exactly(backward_inside):
    rec = recipe.DelayedScaling(amax_history_len=4)
    want = _train(_Twice(), rec, _plain, backward_inside, steps=4)
    got = _train(_Twice(), rec, _checkpointed, backward_inside, steps=4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    plain, nested = _block(), _block()
    want = _train(plain, rec, lambda s, x: s(x), backward_inside)
    got = _train(nested, rec, _nested_outer, backward_inside)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(_histories(nested), _histories(plain), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_inside_a_compiled_function():
    # Dynamo runs it eagerly (a graph break), never tracing torch's checkpoint with our
    # contexts (which it could not); the result is the eager one.
    seq = _block()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fusible.checkpoint(seq, x) * 2, backend="eager")
    x = torch.randn(4, 32, dtype=D, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    with fusible.autocast(recipe=recipe.Float8CurrentScaling()):
        y = compiled(x)
        yr = fusible.checkpoint(seq, xr) * 2
    torch.testing.assert_close(y, yr, rtol=0, atol=0)
    y.sum().backward()
    yr.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)


def test_plain_torch_checkpoint_differs_where_the_backward_leaves_the_autocast():
    # The reason fusible.checkpoint exists: torch's recomputes without FP8 there.
    rec = recipe.Float8CurrentScaling()
    want = _train(_block(), rec, _plain, backward_inside=False, steps=1)

    def torch_checkpoint(seq, x):
        return torch.utils.checkpoint.checkpoint(seq, x, use_reentrant=False)

    got = _train(_block(), rec, torch_checkpoint, backward_inside=False, steps=1)
    assert not torch.equal(got[1], want[1])  # the input gradient


def test_without_an_autocast_and_with_a_context_fn():
    seq = _block()
    x = torch.randn(8, 32, dtype=D, requires_grad=True)
    entered = []

    def context_fn():
        return _Note(entered, "forward"), _Note(entered, "recompute")

    ref = copy.deepcopy(seq)
    xr = x.detach().clone().requires_grad_()
    y = fusible.checkpoint(seq, x, context_fn=context_fn)
    y.sum().backward()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    assert entered == ["forward", "recompute"]
    with pytest.raises(ValueError, match="use_reentrant=False"):
        fusible.checkpoint(seq, x, use_reentrant=True)


class _Note:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.append(self.name)

    def __exit__(self, *exc):
        return False

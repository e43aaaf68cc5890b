"""torch.func transforms through fusible calls (grad, vjp, vmap, jacrev, functional_call + grad,
stack_module_state ensembling), each against torch.func on the equivalent torch.nn model in
float64; forward-mode AD and second derivatives refused by name."""

import copy

import fusible  # noqa: F401
import pytest
import torch
from fusible import ops
from torch.func import functional_call, grad, jacrev, stack_module_state, vjp, vmap

D = torch.float64


def _pair(seed=0):
    """A fusible MLP and the torch.nn model with the same (random, nonzero) parameters."""
    torch.manual_seed(seed)
    ours = ops.Sequential(
        ops.LayerNorm(8, dtype=D, device="cpu"),
        ops.Linear(8, 6, dtype=D, device="cpu"),
        ops.GELU(),
        ops.Linear(6, 4, dtype=D, device="cpu"),
    )
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    ref = torch.nn.Sequential(
        torch.nn.LayerNorm(8, dtype=D),
        torch.nn.Linear(8, 6, dtype=D),
        torch.nn.GELU(approximate="tanh"),
        torch.nn.Linear(6, 4, dtype=D),
    )
    with torch.no_grad():
        for i in (0, 1, 3):
            ref[i].weight.copy_(ours[i].weight)
            ref[i].bias.copy_(ours[i].bias)
    return ours, ref


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_grad_of_a_functional_call_over_the_parameters():
    ours, ref = _pair()
    x = torch.randn(5, 8, dtype=D)

    def loss(params, model):
        return functional_call(model, params, (x,)).square().sum()

    got = grad(loss)(dict(ours.named_parameters()), ours)
    want = grad(loss)(dict(ref.named_parameters()), ref)
    assert len(got) == len(want) == 6
    for g, w in zip(got.values(), want.values(), strict=True):
        _close(g, w)


def test_grad_vjp_vmap_and_jacrev_over_the_input():
    ours, ref = _pair(1)
    x = torch.randn(5, 8, dtype=D)
    _close(grad(lambda t: ours(t).sum())(x), grad(lambda t: ref(t).sum())(x))
    y, f = vjp(ours, x)
    y_ref, f_ref = vjp(ref, x)
    v = torch.randn_like(y)
    _close(y, y_ref)
    _close(f(v)[0], f_ref(v)[0])
    _close(vmap(ours)(x.unsqueeze(1)), vmap(ref)(x.unsqueeze(1)))
    _close(jacrev(ours)(x[0]), jacrev(ref)(x[0]))
    _close(vmap(jacrev(ours))(x), vmap(jacrev(ref))(x))  # per-sample jacobians


def test_ensembling_with_stack_module_state():
    pairs = [_pair(seed) for seed in range(3)]
    x = torch.randn(5, 8, dtype=D)
    outs = []
    for models in zip(*pairs, strict=True):
        params, buffers = stack_module_state(list(models))
        base = copy.deepcopy(models[0])

        def call(p, b, t, base=base):
            return functional_call(base, (p, b), (t,))

        outs.append(vmap(call, in_dims=(0, 0, None))(params, buffers, x))
    _close(outs[0], outs[1])
    _close(outs[0], torch.stack([ours(x) for ours, _ in pairs]))


def test_a_single_op_under_grad_and_vmap():
    lin = ops.Linear(8, 4, dtype=D, device="cpu")
    with torch.no_grad():
        lin.bias.normal_()
    x = torch.randn(5, 8, dtype=D)
    _close(grad(lambda t: lin(t).square().sum())(x), 2 * lin(x) @ lin.weight.detach())
    _close(vmap(lin)(x.unsqueeze(1)).squeeze(1), lin(x))


def test_forward_mode_and_second_derivatives_are_refused_by_name():
    ours, _ = _pair()
    x = torch.randn(5, 8, dtype=D)
    with pytest.raises(NotImplementedError, match="forward-mode AD .* is not supported"):
        torch.func.jvp(ours, (x,), (torch.ones_like(x),))
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        with pytest.raises(NotImplementedError, match="forward-mode AD .* is not supported"):
            ours(dual)
    with pytest.raises(NotImplementedError, match="second derivative"):
        grad(lambda t: grad(lambda u: ours(u).sum())(t).sum())(x)


def test_a_training_dropout_under_grad_draws_the_forwards_mask():
    model = ops.Sequential(ops.Linear(8, 8, dtype=D, device="cpu"), ops.Dropout(0.5))
    x = torch.randn(4, 8, dtype=D)
    xr = x.clone().requires_grad_()
    torch.manual_seed(5)
    (want,) = torch.autograd.grad(model(xr).square().sum(), xr)
    torch.manual_seed(5)
    got = grad(lambda t: model(t).square().sum())(x)
    _close(got, want)
    model.eval()
    _close(grad(lambda t: model(t).sum())(x), model[0].weight.detach().sum(0).expand(4, 8))


def test_fp8_autocast_under_a_transform_is_refused():
    ours, _ = _pair()
    x = torch.randn(5, 8, dtype=torch.float32)
    ours = ours.float()
    with fusible.autocast():
        with pytest.raises(NotImplementedError, match="FP8.* under torch.func"):
            grad(lambda t: ours(t).sum())(x)


def test_vmap_of_grad_over_a_training_dropout_gives_each_sample_its_own_masks_gradient():
    # Per-sample gradients (DP-SGD): each sample's backward replays the state its forward drew.
    torch.manual_seed(2)
    model = ops.Sequential(ops.Linear(8, 8, dtype=D, device="cpu"), ops.Dropout(0.5))
    with torch.no_grad():
        model[0].bias.uniform_(-1, 1)  # a zero bias would hide a bias error
    x = torch.randn(4, 8, dtype=D)

    def loss(t):
        y = model(t)
        return y.square().sum(), y

    g, y = vmap(grad(loss, has_aux=True), randomness="different")(x)
    masks = y != 0
    assert not all(torch.equal(masks[0], m) for m in masks[1:])  # the samples drew apart
    w, b = model[0].weight.detach(), model[0].bias.detach()
    for i in range(4):
        # d/dx of sum((mask * (x W^T + b) * 2)^2) = 8 mask^2 (x W^T + b) W
        want = (masks[i] * 8 * (x[i] @ w.T + b)) @ w
        _close(g[i], want)


def test_vmap_randomness_modes_over_a_training_dropout():
    drop = ops.Dropout(0.5)
    x = torch.ones(6, 64, dtype=D)
    with pytest.raises(RuntimeError, match="randomness error mode"):
        vmap(drop)(x)  # torch's default, "error", as for torch.nn.Dropout
    same = vmap(drop, randomness="same")(x)
    assert all(torch.equal(same[0], row) for row in same[1:])
    different = vmap(drop, randomness="different")(x)
    assert not all(torch.equal(different[0], row) for row in different[1:])
    with torch.no_grad():  # the modes hold without autograd too
        with pytest.raises(RuntimeError, match="randomness error mode"):
            vmap(drop)(x)
        same = vmap(drop, randomness="same")(x)
    assert all(torch.equal(same[0], row) for row in same[1:])
    drop.eval()
    torch.testing.assert_close(vmap(drop)(x), x, rtol=0, atol=0)  # no draw: no randomness mode


def test_vmap_of_jacrev_over_a_training_dropout_uses_each_samples_mask():
    # jacrev's own vmap (over basis vectors) runs inside the sample vmap: each sample's Jacobian
    # is diag(2 * its mask), from the state that sample drew.
    drop = ops.Dropout(0.5)

    def f(t):
        y = drop(t)
        return y, y

    jac, y = vmap(jacrev(f, has_aux=True), randomness="different")(torch.ones(4, 6, dtype=D))
    masks = y != 0
    assert not all(torch.equal(masks[0], m) for m in masks[1:])
    for i in range(4):
        _close(jac[i], torch.diag(2.0 * masks[i].to(D)))

"""fusible.functional.cross_entropy and its kernels (cross_entropy_fwd / cross_entropy_bwd) against
torch.nn.functional.cross_entropy in float64, forward and backward, with ignored targets, on CPU
and CUDA (the 16-byte and the one-element paths)."""

import pytest
import torch
import torch.nn.functional as TF
from conftest import DEVICES, HAS_CUDA, assert_close_to_ref
from fusible.functional import cross_entropy

F = torch.ops.fusible

# (leading shape, classes): 16384 and 64 take 16-byte vectors on CUDA, 37 and 5 one element.
SHAPES = [((4, 7), 64), ((13,), 37), ((2, 3), 16384), ((1,), 5)]
DTYPES = [torch.bfloat16, torch.float32, torch.float64]


def _inputs(lead, classes, dtype, device, ignore=True):
    logits = (torch.randn(*lead, classes, device=device) * 3).to(dtype)
    targets = torch.randint(classes, lead, device=device)
    if ignore and targets.numel() > 2:
        targets.view(-1)[::3] = -100
    return logits, targets


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_torch_in_float64(device, dtype, shape, reduction):
    logits, targets = _inputs(*shape, dtype, device)
    logits.requires_grad_(True)
    loss = cross_entropy(logits, targets, reduction=reduction)
    x64 = logits.detach().double().requires_grad_(True)
    ref = TF.cross_entropy(x64.flatten(0, -2), targets.flatten(), reduction=reduction)
    ref = ref.view(targets.shape) if reduction == "none" else ref
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == out_dtype and loss.shape == ref.shape
    # Math in float32 from logits of the given dtype: float32's tolerance (bf16 inputs are exact).
    assert_close_to_ref(loss, ref, out_dtype)
    grad = torch.randn_like(ref)
    (loss * grad.to(loss.dtype)).sum().backward()
    (ref_grad,) = torch.autograd.grad((ref * grad).sum(), x64)
    assert logits.grad.dtype == dtype
    assert_close_to_ref(logits.grad, ref_grad, dtype)
    ignored = targets == -100
    assert not logits.grad[ignored].any()


def test_gradcheck_in_float64():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, -100, 3, 3])
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, targets), (logits,))
    assert torch.autograd.gradcheck(
        lambda x: cross_entropy(x, targets, reduction="none"), (logits,)
    )


def test_large_logits_do_not_overflow():
    # exp(1000) overflows float32: the running max keeps the sum finite.
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [-5e4, -5e4, -5e4]])
    loss = cross_entropy(logits, torch.tensor([0, 1]), reduction="none")
    want = TF.cross_entropy(logits.double(), torch.tensor([0, 1]), reduction="none")
    torch.testing.assert_close(loss.double(), want)


def test_all_targets_ignored_gives_nan_mean_as_torch():
    logits = torch.randn(3, 4)
    targets = torch.full((3,), -100)
    assert torch.isnan(cross_entropy(logits, targets))
    assert torch.isnan(TF.cross_entropy(logits, targets))
    assert cross_entropy(logits, targets, reduction="sum") == 0


def test_custom_ignore_index():
    logits, targets = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 4, 2, 2, 1, 3])
    got = cross_entropy(logits, targets, ignore_index=2)
    torch.testing.assert_close(got, TF.cross_entropy(logits, targets, ignore_index=2))


def test_under_torch_compile_equals_eager():
    logits, targets = _inputs((4, 5), 33, torch.float32, "cpu")
    logits.requires_grad_(True)
    f = lambda x: cross_entropy(x * 2, targets)  # noqa: E731
    eager = f(logits)
    (g_eager,) = torch.autograd.grad(eager, logits)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(logits)
    (g_compiled,) = torch.autograd.grad(compiled, logits)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_compiled, g_eager)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: cross_entropy(torch.randn(3, 4), torch.tensor([0, 1])),
            ValueError,
            "same leading",
        ),
        (
            lambda: cross_entropy(torch.randn(2, 4), torch.tensor([0, 1]), reduction="avg"),
            ValueError,
            "reduction",
        ),
        (
            lambda: F.cross_entropy_fwd(torch.randn(2, 4), torch.tensor([0, 1]).int()),
            TypeError,
            "int64",
        ),
        (
            lambda: F.cross_entropy_fwd(torch.randn(2, 4), torch.tensor([0, 1, 2])),
            RuntimeError,
            "expected 2 targets",
        ),
        (
            lambda: F.cross_entropy_fwd(torch.randn(2, 4), torch.tensor([0, 4])),
            IndexError,
            "cross_entropy_fwd: expected targets in \\[0, 4\\) or ignore_index \\(-100\\), got 4",
        ),
        (
            lambda: F.cross_entropy_bwd(
                torch.ones(2, dtype=torch.float64),
                torch.randn(2, 4),
                torch.tensor([0, 1]),
                torch.ones(2, 2),
            ),
            RuntimeError,
            "dloss of dtype Float",
        ),
        (
            lambda: F.cross_entropy_bwd(
                torch.ones(2), torch.randn(2, 4), torch.tensor([0, 1]), torch.ones(2)
            ),
            RuntimeError,
            "stats of dtype Float and shape \\[2, 2\\]",
        ),
    ],
)
def test_bad_arguments_raise(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
def test_cuda_out_of_range_target_gives_nan_not_a_crash():
    logits = torch.randn(3, 8, device="cuda")
    loss = cross_entropy(logits, torch.tensor([1, 9, 2], device="cuda"), reduction="none")
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()

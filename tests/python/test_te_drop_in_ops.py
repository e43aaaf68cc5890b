"""Issue 14 (te.ops drop-in), second part: the GLU family's te.ops keywords (glu_interleave_size,
glu_linear_offset) and its new members' errors, and BasicLinear(accumulate_into_main_grad=True)
(Megatron's weight.main_grad). The new activations' values and gradients against float64 run
with every other basic op in test_basic_ops.py (op_specs.py)."""

import pytest
import torch
from conftest import HAS_CUDA
from fusible import ops

D = torch.float64


def _interleave(x, k):
    """[a | b] halves to te.ops' interleaved layout (blocks of k a-columns, then k b-columns)."""
    a, b = x.chunk(2, dim=-1)
    n = a.shape[-1]
    return torch.stack([a.reshape(-1, n // k, k), b.reshape(-1, n // k, k)], 2).reshape(x.shape)


@pytest.mark.parametrize(
    "plain, interleaved",
    [
        (lambda: ops.SwiGLU(), lambda: ops.SwiGLU(glu_interleave_size=4)),
        (lambda: ops.GEGLU(), lambda: ops.GEGLU(glu_interleave_size=2)),
        (lambda: ops.SiTUGLU(), lambda: ops.SiTUGLU(glu_interleave_size=8)),
        (
            lambda: ops.ClampedSwiGLU(glu_linear_offset=0.0),
            lambda: ops.ClampedSwiGLU(glu_linear_offset=0.0, glu_interleave_size=4),
        ),
    ],
)
def test_interleaved_input_equals_halves_input(plain, interleaved):
    torch.manual_seed(0)
    op = interleaved()
    x = torch.randn(5, 32, dtype=D, requires_grad=True)
    xi = _interleave(x.detach(), op.glu_interleave_size).requires_grad_()
    y, yi = plain()(x), op(xi)
    torch.testing.assert_close(yi, y, rtol=0, atol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    yi.backward(dy)
    torch.testing.assert_close(xi.grad, _interleave(x.grad, op.glu_interleave_size), rtol=0, atol=0)


def test_scaled_ops_take_the_interleave_size_positionally():
    torch.manual_seed(0)
    x, s = torch.randn(3, 16, dtype=D), torch.rand(3, dtype=D)
    xi = _interleave(x, 4)
    torch.testing.assert_close(ops.ScaledSwiGLU(4)(xi, s), ops.ScaledSwiGLU()(x, s))
    torch.testing.assert_close(ops.ScaledSiTUGLU(4)(xi, s), ops.ScaledSiTUGLU()(x, s))
    torch.testing.assert_close(ops.ScaledClampedQGeGLU(4)(xi, s), ops.ScaledClampedQGeGLU()(x, s))


def test_glu_linear_offset_changes_the_linear_half():
    x = torch.randn(4, 8, dtype=D)
    a, b = x.chunk(2, -1)
    a, b = a.clamp(max=7.0), b.clamp(-7.0, 7.0)
    for offset in (0.0, 1.0, -0.5):
        want = a * torch.sigmoid(1.702 * a) * (b + offset)
        torch.testing.assert_close(ops.ClampedSwiGLU(glu_linear_offset=offset)(x), want)


def test_situglu_is_bounded_by_the_betas():
    x = torch.randn(64, 32, dtype=D) * 100
    y = ops.SiTUGLU(beta1=2.0, beta2=3.0)(x)
    assert y.abs().max() <= 6.0


@pytest.mark.parametrize(
    "make, match, error",
    [
        (lambda: ops.SiTUGLU(beta1=0.0), "beta1", ValueError),
        (lambda: ops.SiTUGLU(beta2=float("inf")), "beta2", ValueError),
        (lambda: ops.ScaledSiTUGLU(beta1=-1.0), "beta1", ValueError),
        (lambda: ops.SwiGLU(glu_interleave_size=0), "glu_interleave_size", ValueError),
        (lambda: ops.SwiGLU(glu_interleave_size=2.5), "glu_interleave_size", TypeError),
        (lambda: ops.ClampedSwiGLU(limit=-1.0), "limit", ValueError),
        (lambda: ops.ScaledTanhSReLU(tanh_clamp_scale=0.0), "tanh_clamp_scale", ValueError),
        (lambda: ops.ScaledTanhSReLU(), "tanh_clamp_scale", TypeError),  # required, as in te
    ],
)
def test_bad_parameters_are_refused_at_construction(make, match, error):
    with pytest.raises(error, match=match):
        make()


def test_interleave_size_must_divide_the_halves():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.SwiGLU(glu_interleave_size=4)(torch.randn(2, 12, dtype=D))
    with pytest.raises(RuntimeError, match="ScaledSiTUGLU.*scales"):
        ops.ScaledSiTUGLU()(torch.randn(2, 8, dtype=D), torch.rand(3, dtype=D))


def test_scaled_srelu_keeps_the_width_and_scales_rows():
    x, s = torch.randn(3, 5, dtype=D), torch.rand(3, dtype=D)
    torch.testing.assert_close(ops.ScaledSReLU()(x, s), s[:, None] * torch.relu(x) ** 2)


def _main_grad_linear(bias, device="cpu"):
    torch.manual_seed(0)
    lin = ops.Linear(8, 6, bias=bias, device=device, dtype=D, accumulate_into_main_grad=True)
    lin.weight.main_grad = torch.zeros(6, 8, dtype=D, device=device)
    return lin


@pytest.mark.parametrize("bias", [True, False])
def test_weight_grad_accumulates_into_main_grad_over_two_steps(bias):
    lin = _main_grad_linear(bias)
    w = lin.weight.detach().clone().requires_grad_()
    want = torch.zeros_like(w)
    for step in range(2):
        x = torch.randn(4, 8, dtype=D)
        dy = torch.randn(4, 6, dtype=D)
        lin(x).backward(dy)
        want += dy.T @ x
        torch.testing.assert_close(lin.weight.main_grad, want)
    assert lin.weight.grad is None  # no grad_added_to_main_grad attribute: no gradient at all
    if bias:
        assert lin.bias.grad is not None  # the bias keeps its ordinary gradient


def test_grad_added_to_main_grad_convention_and_overwrite():
    lin = _main_grad_linear(bias=False)
    lin.weight.grad_added_to_main_grad = False
    lin.weight.zero_out_wgrad = True
    x, dy = torch.randn(4, 8, dtype=D), torch.randn(4, 6, dtype=D)
    lin(x).backward(dy)
    assert lin.weight.grad_added_to_main_grad is True
    assert torch.equal(lin.weight.grad, torch.zeros_like(lin.weight))
    lin.weight.overwrite_main_grad = True
    lin.weight.grad = None
    x2, dy2 = torch.randn(4, 8, dtype=D), torch.randn(4, 6, dtype=D)
    lin(x2).backward(dy2)
    torch.testing.assert_close(lin.weight.main_grad, dy2.T @ x2)


def test_main_grad_in_a_fused_mlp_with_other_ops():
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.Linear(8, 16, device="cpu", dtype=D, accumulate_into_main_grad=True),
        ops.GELU(),
        ops.Linear(16, 8, device="cpu", dtype=D),
    )
    fc1 = seq[0]
    fc1.weight.main_grad = torch.zeros_like(fc1.weight)
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    seq(x).sum().backward()
    ref_w = fc1.weight.detach().clone().requires_grad_()
    h = torch.nn.functional.gelu(x.detach() @ ref_w.T + fc1.bias.detach(), approximate="tanh")
    (h @ seq[2].weight.detach().T).sum().backward()
    torch.testing.assert_close(fc1.weight.main_grad, ref_w.grad)
    assert fc1.weight.grad is None and seq[2].weight.grad is not None


def test_missing_main_grad_is_a_clear_error():
    lin = ops.BasicLinear(8, 6, device="cpu", dtype=D, accumulate_into_main_grad=True)
    y = lin(torch.randn(2, 8, dtype=D))
    with pytest.raises(RuntimeError, match="main_grad"):
        y.sum().backward()
    lin.weight.main_grad = torch.zeros(6, 8, dtype=D)
    lin(torch.randn(2, 8, dtype=D)).sum().backward()  # the op still works afterwards
    assert lin.weight.main_grad.abs().sum() > 0


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_main_grad_fp32_with_bf16_weights_on_cuda():
    torch.manual_seed(0)
    lin = ops.Linear(64, 32, device="cuda", dtype=torch.bfloat16, accumulate_into_main_grad=True)
    lin.weight.main_grad = torch.zeros(32, 64, device="cuda", dtype=torch.float32)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    lin(x).backward(dy)
    lin(x).backward(dy)
    want = 2 * (dy.double().T @ x.double())
    torch.testing.assert_close(
        lin.weight.main_grad.double().cpu(), want.cpu(), rtol=2e-2, atol=1e-2
    )

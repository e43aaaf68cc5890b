"""split_qkv_rotary and its kernels (qkv_rotary_fwd / qkv_rotary_bwd): rotary embedding fused with
the split of a packed projection into heads, against a float64 reference written with plain
PyTorch ops, forward and backward, on CPU and CUDA (both the 16-byte and the one-pair paths)."""

import math

import fusible
import pytest
import torch
from conftest import DEVICES, HAS_CUDA, assert_close_to_ref
from fusible.functional import split_qkv_rotary

F = torch.ops.fusible


def _tables(seq, head_dim, dtype=torch.float32, device="cpu"):
    half = torch.arange(0, head_dim, 2, dtype=torch.float64)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), 10000.0 ** (-half / head_dim))
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _reference(qkv, num_heads, cos, sin):
    """(q, k, v) [batch, heads, seq, head_dim] in float64: interleaved pairs rotated."""
    batch, seq, width = qkv.shape
    x = qkv.view(batch, seq, 3, num_heads, width // (3 * num_heads)).permute(2, 0, 3, 1, 4)
    c, s = cos[:seq].double(), sin[:seq].double()

    def rotate(t):
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * c - odd * s, even * s + odd * c), -1).flatten(-2)

    return rotate(x[0]), rotate(x[1]), x[2]


# (batch, seq, heads, head_dim, table rows): head_dim 64 and 16 take the 16-byte path on CUDA,
# 6 the one-pair path; tables longer than seq are read from row 0.
SHAPES = [(2, 5, 3, 64, 5), (1, 7, 2, 6, 11), (3, 4, 1, 16, 4), (1, 1, 4, 2, 3)]
DTYPES = [torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backward_match_the_reference(device, dtype, shape):
    batch, seq, heads, head_dim, rows = shape
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = _tables(rows, head_dim, table_dtype, device)
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, device=device).to(dtype)
    qkv.requires_grad_(True)
    outs = split_qkv_rotary(qkv, heads, cos, sin)
    x64 = qkv.detach().double().requires_grad_(True)
    refs = _reference(x64, heads, cos, sin)
    for out, ref in zip(outs, refs):
        assert out.shape == (batch, heads, seq, head_dim) and out.dtype == dtype
        assert_close_to_ref(out, ref, dtype)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    (ref_grad,) = torch.autograd.grad(refs, x64, [g.double() for g in grads])
    assert_close_to_ref(qkv.grad, ref_grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_takes_any_strides_of_the_gradients(device):
    # SDPA's gradients are views of [batch, seq, heads, head_dim]; the kernel reads them in place.
    batch, seq, heads, head_dim = 2, 6, 3, 16
    cos, sin = _tables(seq, head_dim, device=device)
    dq, dk, dv = (
        torch.randn(batch, seq, heads, head_dim, device=device).transpose(1, 2) for _ in range(3)
    )
    dk = torch.randn(batch, heads, head_dim, seq, device=device).transpose(2, 3)  # last dim strided
    got = F.qkv_rotary_bwd(dq, dk, dv, cos, sin)
    want = F.qkv_rotary_bwd(dq.contiguous(), dk.contiguous(), dv.contiguous(), cos, sin)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_v_is_a_view_of_the_projection_and_q_k_one_new_tensor():
    qkv = torch.randn(2, 3, 3 * 2 * 4)
    cos, sin = _tables(3, 4)
    q, k, v = split_qkv_rotary(qkv, 2, cos, sin)
    assert v.data_ptr() == qkv.data_ptr() + 2 * 2 * 4 * qkv.element_size()
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert q.stride(-1) == 1 and k.stride(-1) == 1


def test_gradcheck_in_float64():
    qkv = torch.randn(2, 3, 3 * 2 * 4, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(5, 4, torch.float64)
    assert torch.autograd.gradcheck(lambda x: split_qkv_rotary(x, 2, cos, sin), (qkv,))


def test_a_rotation_keeps_each_pairs_norm_and_position_zero_is_the_identity():
    # Independent of the reference: the rotation is orthogonal, and angle 0 (position 0) is none.
    qkv = torch.randn(1, 4, 3 * 8, dtype=torch.float64)
    cos, sin = _tables(4, 8, torch.float64)
    q, k, _ = split_qkv_rotary(qkv, 1, cos, sin)
    x = qkv.view(1, 4, 3, 1, 8)
    torch.testing.assert_close(q[0, 0, 0], x[0, 0, 0, 0])
    pair_norm = lambda t: t.reshape(*t.shape[:-1], -1, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(k[0, 0]), pair_norm(x[0, :, 1, 0]))
    # Pair 0 of position 3 turns by 3 radians.
    e, o = x[0, 3, 0, 0, 0], x[0, 3, 0, 0, 1]
    want = torch.stack([e * math.cos(3) - o * math.sin(3), e * math.sin(3) + o * math.cos(3)])
    torch.testing.assert_close(q[0, 0, 3, :2], want)


def test_under_torch_compile_equals_eager():
    qkv = torch.randn(2, 5, 3 * 2 * 8, requires_grad=True)
    cos, sin = _tables(5, 8)

    def f(x):
        q, k, v = split_qkv_rotary(x, 2, cos, sin)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    eager = f(qkv)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), qkv)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(qkv)
    (g_compiled,) = torch.autograd.grad(compiled.square().sum(), qkv)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(g_compiled, g_eager)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c, s: F.qkv_rotary_fwd(torch.randn(2, 3, 18), c, s, 2), "last dim to be 3 \\*"),
        (lambda c, s: F.qkv_rotary_fwd(torch.randn(2, 3, 24), c, s, 0), "num_heads > 0"),
        (lambda c, s: F.qkv_rotary_fwd(torch.randn(2, 24), c, s, 2), "qkv to have 3 dims"),
        (
            lambda c, s: F.qkv_rotary_fwd(torch.randn(2, 9, 24), c, s, 2),
            "cos of shape \\[>= 9, 2\\]",
        ),
        (
            lambda c, s: F.qkv_rotary_fwd(torch.randn(2, 3, 48), c, s, 2),
            "cos of shape \\[>= 3, 4\\]",
        ),
        (
            lambda c, s: F.qkv_rotary_bwd(
                *[torch.randn(1, 2, 3, 4)] * 2, torch.randn(1, 2, 3, 2), c, s
            ),
            "dv of shape",
        ),
        (
            lambda c, s: F.qkv_rotary_bwd(*[torch.zeros(1, 2, 3, 4, dtype=torch.int32)] * 3, c, s),
            "floating-point",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_op_and_argument(call, message):
    cos, sin = _tables(8, 4)
    with pytest.raises(Exception, match=message):
        call(cos, sin)


def test_tables_that_require_grad_are_refused():
    cos, sin = _tables(3, 4)
    with pytest.raises(ValueError, match="take no gradient"):
        split_qkv_rotary(torch.randn(1, 3, 12), 1, cos.requires_grad_(), sin)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
@pytest.mark.parametrize(
    "dtype, offset", [(torch.bfloat16, 0), (torch.bfloat16, 2), (torch.float64, 1)]
)
def test_cuda_matches_cpu_on_unaligned_and_aligned_views(dtype, offset):
    # An offset breaks 16-byte alignment: the one-pair path runs, element by element (one pair of
    # doubles is 16 bytes too, but only 8-byte aligned here).
    heads, head_dim = 4, 64
    base = torch.randn(2 * 9 * 3 * heads * head_dim + offset, device="cuda").to(dtype)
    qkv = base[offset:].view(2, 9, 3 * heads * head_dim)
    table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    cos, sin = _tables(9, head_dim, table_dtype, device="cuda")
    got = F.qkv_rotary_fwd(qkv, cos, sin, heads)
    want = F.qkv_rotary_fwd(qkv.cpu(), cos.cpu(), sin.cpu(), heads)
    assert_close_to_ref(got, want.double(), dtype)
    assert fusible.cuda_built


@pytest.mark.parametrize("shape", [(0, 6, 24), (2, 0, 24)])
def test_an_empty_batch_or_sequence(shape):
    cos, sin = _tables(6, 4)
    qkv = torch.randn(*shape, requires_grad=True)
    q, k, v = split_qkv_rotary(qkv, 2, cos, sin)
    want = (shape[0], 2, shape[1], 4)
    assert q.shape == want and k.shape == want and v.shape == want
    (q.sum() + k.sum() + v.sum()).backward()
    assert qkv.grad.shape == qkv.shape

"""LayerNorm and RMSNorm over an input wider than their compute dtype: a float32 residual stream
beside bf16 / fp16 weights (autocast, or 16-bit parameters). The norm reads x as it is and rounds it
to the compute dtype on load, as a cast would (the same y as norming x.to(dtype)); the backward
returns dx in x's dtype, computed in float32 and rounded once (held to float32's tolerance, so a dx
rounded through bf16 fails), and adds a float32 dextra in the same pass. No conversion runs before
or after the norm. Kernel ops on CPU and CUDA, then the ops under a fuser, with a few optimizer
steps against a float64 reference."""

import pytest
import torch
import torch.nn.functional as TF
from conftest import DEVICES, OpLog, assert_close_to_ref, cuda_only, randomized, tols
from fusible import ops

F = torch.ops.fusible
HALF = [torch.bfloat16, torch.float16]
# One row; widths not a multiple of 8 (one element per access: the backward's one-pass kernel up
# to 1024 of them, 2052 past it); several row chunks; 20000: rows the forward and the backward keep
# in shared memory (the backward's dx pass, then its separate parameter pass).
SHAPES = [(1, 8), (7, 33), (64, 1000), (4, 2052), (5, 4096), (300, 96), (2, 20000)]


def _rand(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype)


def _ref(t):
    return t.detach().double().cpu()


def _close_fp32(actual, ref64):
    """A float32 result computed in float32 from 16-bit inputs: float32's reduction tolerance, far
    below a bf16 / fp16 rounding of it."""
    assert actual.dtype == torch.float32
    rtol, atol = tols(torch.float32, gemm=True)  # "cpu": no TF32 allowance, as none is used
    torch.testing.assert_close(_ref(actual), ref64, rtol=rtol, atol=atol)


def _reference(kind, x, w, b, zero_centered_gamma, dy):
    """The norm's formula in float64 with autograd, independent of fusible's ops: y, the statistics
    (mean and rstd, or rstd) and the gradients of x, weight (and bias) for the output gradient dy.
    """
    x, w, b = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    g = w + 1 if zero_centered_gamma else w
    if kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + 1e-5)
        y, stats, params = (x - mu) * rstd * g + b, (mu, rstd), (w, b)
    else:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        y, stats, params = x * rstd * g, (rstd,), (w,)
    grads = torch.autograd.grad(y, (x, *params), _ref(dy))
    return y.detach(), [st.detach().squeeze(-1) for st in stats], grads


def _norm(kind, x, w, b, zero_centered_gamma):
    if kind == "layernorm":
        return F.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma)
    return F.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma)


def _norm_bwd(kind, dy, x, stats, w, zero_centered_gamma, dextra=None):
    if kind == "layernorm":
        if dextra is None:
            return F.layernorm_bwd(dy, x, *stats, w, zero_centered_gamma)
        return F.layernorm_bwd_add(dy, x, *stats, w, zero_centered_gamma, dextra)
    if dextra is None:
        return F.rmsnorm_bwd(dy, x, *stats, w, zero_centered_gamma)
    return F.rmsnorm_bwd_add(dy, x, *stats, w, zero_centered_gamma, dextra)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("offset", [0, 1])
def test_kernels_read_float32_x_beside_16bit_weights(kind, dtype, shape, device, offset):
    """offset 1: x starts 4 bytes past a 16-byte boundary (one element per access)."""
    zcg = shape[-1] % 2 == 1  # zero-centered gamma on the odd widths
    h = shape[-1]
    n = torch.Size(shape).numel()
    x = (torch.randn(n + offset, device=device) * 2 + 0.5)[offset:].view(shape)
    w, b = _rand(h, dtype, device, 0.5), _rand(h, dtype, device)
    dy, dextra = _rand(shape, dtype, device), _rand(shape, torch.float32, device)
    out = _norm(kind, x, w, b, zcg)
    y, stats = out[0], out[1:]
    assert y.dtype == dtype and all(s.dtype == torch.float32 for s in stats)
    # The forward: x rounded to the compute dtype first, as norming x.to(dtype) does.
    ry, rstats, rgrads = _reference(kind, x.to(dtype), w, b, zcg, dy)
    for a, r in zip(out, (ry, *rstats)):
        assert_close_to_ref(a, r, a.dtype if a.dtype != torch.float32 else dtype)
    if device == "cpu":
        same = _norm(kind, x.to(dtype), w, b, zcg)
        assert all(torch.equal(a, s) for a, s in zip(out, same))
    # The backward: dx in float32, rounded once; the parameter gradients in weight's dtype.
    grads = _norm_bwd(kind, dy, x, stats, w, zcg)
    _close_fp32(grads[0], rgrads[0])
    rtol, atol = tols(dtype, gemm=True)  # sums over the rows
    for a, r in zip(grads[1:], rgrads[1:]):
        assert a.dtype == dtype
        torch.testing.assert_close(_ref(a), r.to(dtype).double(), rtol=rtol, atol=max(atol, 1e-4))
    fused = _norm_bwd(kind, dy, x, stats, w, zcg, dextra)
    _close_fp32(fused[0], rgrads[0] + _ref(dextra))
    for a, g in zip(fused[1:], grads[1:]):  # the same sums with or without dextra
        assert torch.equal(a, g)


@pytest.mark.parametrize("device", DEVICES)
def test_other_dtype_mixes_convert(device):
    """x narrower than weight, or float64 beside float32: computed in weight's dtype, y in it, dx in
    x's dtype."""
    for x_dtype, w_dtype in [(torch.bfloat16, torch.float32), (torch.float64, torch.float32)]:
        x = _rand((6, 40), x_dtype, device)
        w, b = _rand(40, w_dtype, device, 0.5), _rand(40, w_dtype, device)
        dy = _rand((6, 40), w_dtype, device)
        y, mean, rstd = F.layernorm_fwd(x, w, b, 1e-5, False)
        ry, _, (rdx, _, _) = _reference("layernorm", x.to(w_dtype), w, b, False, dy)
        assert y.dtype == w_dtype
        assert_close_to_ref(y, ry, w_dtype)
        dx, dw, db = F.layernorm_bwd(dy, x, mean, rstd, w, False)
        assert dx.dtype == x_dtype and dw.dtype == db.dtype == w_dtype
        assert_close_to_ref(dx, rdx, x_dtype if x_dtype != torch.float64 else w_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_float8_x_is_converted_first(device):
    """A dtype the kernels are not built for (float8 data) is converted to weight's first."""
    x = _rand((4, 32), torch.float32, device).to(torch.float8_e4m3fn)
    w, b = _rand(32, torch.bfloat16, device), _rand(32, torch.bfloat16, device)
    out = F.layernorm_fwd(x, w, b, 1e-5, False)
    same = F.layernorm_fwd(x.to(torch.bfloat16), w, b, 1e-5, False)
    assert all(torch.equal(a, s) for a, s in zip(out, same))


@pytest.mark.parametrize("device", DEVICES)
def test_dextra_must_be_in_x_dtype(device):
    x = _rand((4, 16), torch.float32, device)
    w = _rand(16, torch.bfloat16, device)
    _, rstd = F.rmsnorm_fwd(x, w, 1e-5, False)
    dy = _rand((4, 16), torch.bfloat16, device)
    with pytest.raises(TypeError, match="rmsnorm_bwd_add: expected x and dextra of the same dtype"):
        F.rmsnorm_bwd_add(dy, x, rstd, w, False, dy)


def _layer(kind, h, dtype, device):
    if kind == "layernorm":
        return ops.LayerNorm(h, dtype=dtype, device=device)
    return ops.RMSNorm(h, dtype=dtype, device=device)


def _reference_norm(kind, x, params, dtype):
    """The float64 reference of the op: x and the parameters rounded to the compute dtype (x's
    rounding passes its gradient through unrounded, as the op's float32 dx)."""
    x = x + (x.to(dtype).double() - x).detach()
    w = params[0].to(dtype).double()
    if kind == "layernorm":
        return TF.layer_norm(x, (x.shape[-1],), w, params[1].to(dtype).double(), 1e-5)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_op_takes_float32_input_without_conversions(kind, device):
    """bf16 parameters, a float32 input: the op calls the norm kernels on x as it is, and nothing
    converts x or dx (the fuser's gradient is already float32)."""
    norm = _layer(kind, 64, torch.bfloat16, device)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(-1.0, 1.0)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    dy = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    with OpLog() as log, torch.profiler.profile() as prof:
        y = norm(x)
        # autograd.grad: no AccumulateGrad, which may copy a gradient it cannot take as it is
        (dx,) = torch.autograd.grad(y, x, dy)
    name = "fusible.layernorm" if kind == "layernorm" else "fusible.rmsnorm"
    assert [c[0] for c in log.calls] == [name + "_fwd", name + "_bwd"], log.calls
    assert log.calls[0][1][0] == torch.float32 and y.dtype == torch.bfloat16
    assert dx.dtype == torch.float32
    if device == "cuda":  # (the CPU reference converts inside the op)
        names = [e.name for e in prof.events()]
        assert "aten::_to_copy" not in names and "aten::copy_" not in names, names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_float32_residual_under_autocast_trains_like_the_reference(kind, dtype, device):
    """MakeExtraOutput + norm (BackwardAdd<Norm> in the backward) on a float32 stream under bf16
    autocast (bf16 and fp16), float32 parameters: y from x rounded to the autocast dtype, x's
    gradient (the norm's plus the residual's) in float32 at float32's tolerance, and the
    parameters after three SGD steps."""
    torch.manual_seed(0)
    norm = _layer(kind, 48, torch.float32, device)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(-1.0, 1.0)
    ref = [_ref(p).clone().requires_grad_() for p in norm.parameters()]  # (on the CPU)
    seq = ops.Sequential(ops.MakeExtraOutput(), norm)
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref, lr=0.1)
    for _ in range(3):
        x = (torch.randn(6, 48, device=device) * 2).requires_grad_()
        gy, gres = torch.randn(6, 48, device=device), torch.randn(6, 48, device=device)
        with torch.autocast(device, dtype=dtype):
            y, residual = seq(x)
        assert y.dtype == dtype and residual.dtype == torch.float32
        opt.zero_grad()
        torch.autograd.backward([y, residual], [gy.to(dtype), gres])
        opt.step()
        rx = _ref(x).requires_grad_()
        ry = _reference_norm(kind, rx, ref, dtype)
        assert_close_to_ref(y, ry, dtype)
        ref_opt.zero_grad()
        torch.autograd.backward([ry, rx], [_ref(gy.to(dtype)), _ref(gres)])
        ref_opt.step()
        _close_fp32(x.grad, rx.grad)
        for p, r in zip(norm.parameters(), ref):
            assert_close_to_ref(p, r, dtype)
    assert seq.fusion_plan()[0]["backward"][0].startswith("BackwardAdd")


@cuda_only
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_cuda_residual_backward_is_one_kernel(kind):
    """On CUDA the fused backward's norm kernel adds the float32 residual gradient itself: no copy
    or add kernel after it."""
    norm = randomized(_layer(kind, 1024, torch.bfloat16, "cuda"))
    seq = ops.Sequential(ops.MakeExtraOutput(), norm)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    y, residual = seq(x)
    gy, gres = torch.randn_like(y), torch.randn_like(residual)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        # autograd.grad: no AccumulateGrad, which may copy a gradient it cannot take as it is
        torch.autograd.grad([y, residual], [x, *norm.parameters()], [gy, gres])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("norm_bwd_one_pass_kernel" in k for k in kernels), kernels
    assert not any("copy" in k or "add" in k.lower() for k in kernels if "norm" not in k), kernels

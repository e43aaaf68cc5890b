"""Every basic op against a float64 PyTorch reference (forward and backward, random data), plus
gradcheck in float64 on CPU."""

import pytest
import torch
from conftest import HAS_CUDA, assert_close_to_ref, tols
from fusible import ops
from op_specs import SPECS

CPU_DTYPES = [torch.float64, torch.float32]
CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _cases():
    for spec in SPECS:
        for dtype in CPU_DTYPES:
            yield pytest.param(
                spec, "cpu", dtype, id=f"{spec.name}-cpu-{dtype}".replace("torch.", "")
            )
        for dtype in CUDA_DTYPES:
            yield pytest.param(
                spec,
                "cuda",
                dtype,
                id=f"{spec.name}-cuda-{dtype}".replace("torch.", ""),
                marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"),
            )


def _randomize(op):
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float64).to(p.dtype) * 0.5 + 0.3)


def _as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


class TestBasicOpsAgainstFloat64:
    @pytest.mark.parametrize("spec,device,dtype", list(_cases()))
    def test_forward_backward(self, spec, device, dtype):
        torch.manual_seed(0)
        op = spec.make(device, dtype)
        _randomize(op)
        x64 = torch.randn(spec.shape, dtype=torch.float64)
        extras64 = [torch.rand(s, dtype=torch.float64) + 0.5 for s in spec.extra_shapes]
        x = x64.to(device, dtype).requires_grad_()
        extras = [e.to(device, dtype).requires_grad_() for e in extras64]
        params = dict(op.named_parameters())

        outs = _as_tuple(op(x, *extras))
        # Reference on the values the op actually saw (inputs rounded to dtype), in float64.
        xr = x.detach().double().cpu().requires_grad_()
        er = [e.detach().double().cpu().requires_grad_() for e in extras]
        pr = {k: v.detach().double().cpu().requires_grad_() for k, v in params.items()}
        refs = _as_tuple(spec.ref(xr, pr, er))
        assert len(outs) == len(refs)
        rtol, atol = tols(dtype, spec.gemm, device)
        for out, ref in zip(outs, refs):
            assert out.dtype == dtype and out.device.type == device
            if spec.exact:
                assert torch.equal(out.detach().double().cpu(), ref.detach().to(dtype).double())
            else:
                assert_close_to_ref(out, ref, dtype, spec.gemm)

        # Upstream gradients rounded to dtype, so the reference sees what the op saw.
        grads64 = [torch.randn(r.shape, dtype=torch.float64).to(dtype).double() for r in refs]
        torch.autograd.backward(outs, [g.to(device, dtype) for g in grads64])
        torch.autograd.backward(refs, grads64)
        pairs = [(x.grad, xr.grad)] + [(e.grad, r.grad) for e, r in zip(extras, er)]
        pairs += [(params[k].grad, pr[k].grad) for k in params]
        for got, want in pairs:
            assert got is not None, "missing gradient"
            if spec.exact:
                assert torch.equal(got.double().cpu(), want.to(dtype).double())
            else:
                # Gradients go through more roundings than the forward: compare at the gemm level.
                r2, a2 = tols(dtype, True, device)
                torch.testing.assert_close(
                    got.double().cpu(),
                    want.to(dtype).double(),
                    rtol=max(r2, rtol) * 4,
                    atol=max(a2, atol) * 4,
                )

    def test_a_wrong_answer_fails(self):
        spec = next(s for s in SPECS if s.name == "Identity")
        x = torch.randn(3, 4, 16, dtype=torch.float64)
        y = spec.make("cpu", torch.float64)(x)
        assert not torch.equal(y, x + 1e-12 * torch.randn_like(x).abs().add(1))


class TestGradcheck:
    @pytest.mark.parametrize("spec", SPECS, ids=repr)
    def test_gradcheck_float64(self, spec):
        torch.manual_seed(1)
        op = spec.make("cpu", torch.float64)
        _randomize(op)
        x = torch.randn(spec.shape, dtype=torch.float64, requires_grad=True)
        extras = [torch.rand(s, dtype=torch.float64) + 0.5 for s in spec.extra_shapes]
        for e in extras:
            e.requires_grad_()
        params = list(op.parameters())

        def f(x, *rest):
            return op(x, *rest[: len(extras)])

        assert torch.autograd.gradcheck(f, (x, *extras, *params), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape", [6, [3, 2], torch.Size([3, 2]), range(3, 1, -1), (3, 2)])
def test_normalized_shape_takes_any_iterable_of_ints(norm, shape):
    """As torch.nn.LayerNorm: an int, a list, a tuple, a torch.Size or a range."""
    op = getattr(ops, norm)(shape, dtype=torch.float64, device="cpu")
    _randomize(op)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    assert op.normalized_shape == dims and op.weight.shape == dims
    x = torch.randn(4, *((3, 2) if len(dims) == 2 else (6,)), dtype=torch.float64)
    if norm == "LayerNorm":
        want = torch.nn.functional.layer_norm(x, dims, op.weight, op.bias, op.eps)
    else:
        want = torch.nn.functional.rms_norm(x, dims, op.weight, op.eps)
    torch.testing.assert_close(op(x), want)
    with pytest.raises(TypeError, match="normalized_shape must be an int"):
        getattr(ops, norm)("6", device="cpu")


def test_shape_errors_name_the_op():
    with pytest.raises(RuntimeError, match=r"Reshape: expected an input whose 12 elements fit"):
        ops.Reshape((5, -1))(torch.randn(3, 4))
    with pytest.raises(RuntimeError, match=r"ScaledSwiGLU: expected input to have at least 1"):
        ops.ScaledSwiGLU()(torch.randn(()), torch.randn(()))

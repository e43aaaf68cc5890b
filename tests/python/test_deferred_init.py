"""Deferred initialization: build on meta, materialize in place on first use."""

import pytest
import torch
from conftest import HAS_CUDA
from fusible import ops

MODELS = {
    "BasicLinear": lambda d, t: ops.BasicLinear(8, 6, device=d, dtype=t),
    "Bias": lambda d, t: ops.Bias(8, device=d, dtype=t),
    "LayerNorm": lambda d, t: ops.LayerNorm(8, device=d, dtype=t),
    "RMSNorm": lambda d, t: ops.RMSNorm(8, device=d, dtype=t),
    "Linear": lambda d, t: ops.Linear(8, 6, device=d, dtype=t),
    "Sequential": lambda d, t: ops.Sequential(
        ops.LayerNorm(8, device=d, dtype=t), ops.Linear(8, 6, device=d, dtype=t)
    ),
}


def _cases():
    for name in MODELS:
        for dtype in (torch.float32, torch.float64):
            yield pytest.param(name, "cpu", dtype, id=f"{name}-cpu-{dtype}".replace("torch.", ""))
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            yield pytest.param(
                name,
                "cuda",
                dtype,
                id=f"{name}-cuda-{dtype}".replace("torch.", ""),
                marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"),
            )


def _linears(model):
    return [
        m
        for m in (model if isinstance(model, ops.Sequential) else [model])
        if isinstance(m, ops.Linear)
    ]


class TestDeferredInit:
    @pytest.mark.parametrize("input_grad", [True, False], ids=["x_grad", "x_no_grad"])
    @pytest.mark.parametrize("name,device,dtype", list(_cases()))
    def test_meta_then_first_forward(self, name, device, dtype, input_grad):
        torch.manual_seed(0)
        model = MODELS[name]("meta", dtype)
        params = list(model.parameters())
        assert params and all(p.is_meta and isinstance(p, torch.nn.Parameter) for p in params)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        x = torch.randn(3, 8, device=device, dtype=dtype, requires_grad=input_grad)
        dy = torch.randn(
            3,
            6 if name in ("BasicLinear", "Linear", "Sequential") else 8,
            device=device,
            dtype=dtype,
        )
        y = model(x)
        y.backward(dy)

        after = list(model.parameters())
        assert all(a is b for a, b in zip(params, after)) and len(params) == len(after)
        for p in after:
            assert p.device.type == device and not p.is_meta
            assert p.grad is not None and p.grad.device.type == device
        assert (x.grad is not None) == input_grad
        for lin in _linears(model):
            assert lin.weight is lin.basic_ops[0].weight and lin.bias is lin.basic_ops[1].bias

        # Same values as a model built directly on the device and loaded with them.
        direct = MODELS[name](device, dtype)
        direct.load_state_dict(model.state_dict())
        x2 = x.detach().clone().requires_grad_(input_grad)
        y2 = direct(x2)
        y2.backward(dy)
        assert torch.equal(y, y2)
        for p, q in zip(model.parameters(), direct.parameters()):
            assert torch.equal(p.grad, q.grad)

        # The optimizer built on the meta parameters steps the materialized ones.
        before = [p.detach().clone() for p in after]
        opt.step()
        for p, b, q in zip(after, before, direct.parameters()):
            torch.testing.assert_close(p.detach(), b - 0.5 * q.grad, rtol=0, atol=0)

    def test_nothing_allocated_on_meta(self):
        model = ops.Linear(1 << 16, 1 << 16, device="meta")  # 16 GiB in fp32 if allocated
        assert all(p.is_meta for p in model.parameters())

    def test_default_init_after_materialization(self):
        torch.manual_seed(0)
        lin = ops.Linear(64, 32, device="meta")
        lin(torch.randn(2, 64))
        assert lin.weight.abs().max() <= 1 / 8 and lin.weight.std() > 1 / 32
        assert torch.equal(lin.bias.detach(), torch.zeros(32))
        ln = ops.LayerNorm(8, device="meta", zero_centered_gamma=True)
        ln(torch.randn(2, 8))
        assert torch.equal(ln.weight.detach(), torch.zeros(8))

    def test_explicit_reset_parameters_under_no_grad(self):
        model = ops.Sequential(ops.LayerNorm(8, device="meta"), ops.Linear(8, 4, device="meta"))
        params = list(model.parameters())
        with torch.no_grad():
            model.reset_parameters()
        expected = "cuda" if HAS_CUDA else "cpu"
        assert all(p.device.type == expected for p in params)
        assert all(a is b for a, b in zip(params, model.parameters()))
        assert torch.equal(model[0].weight.detach().cpu(), torch.ones(8))
        x = torch.randn(2, 8, device=expected, requires_grad=True)
        model(x).sum().backward()
        assert all(p.grad is not None for p in params) and x.grad is not None

    @pytest.mark.parametrize("name", list(MODELS))
    def test_load_state_dict_into_a_meta_model_takes_effect(self, name):
        """torch's copy into a meta parameter is a no-op (a warning), and the first forward would
        then initialize it at random, dropping the checkpoint: the loaded values are used, the
        parameters keep their identity (an optimizer built before still trains them)."""
        torch.manual_seed(7)
        trained = MODELS[name]("cpu", torch.float64)
        with torch.no_grad():
            for p in trained.parameters():
                p.uniform_(-1, 1)
        model = MODELS[name]("meta", torch.float64)
        params = list(model.parameters())
        result = model.load_state_dict(trained.state_dict())
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert all(a is b for a, b in zip(params, model.parameters()))
        for a, b in zip(model.parameters(), trained.parameters()):
            assert not a.is_meta and torch.equal(a.detach(), b.detach())
        x = torch.randn(3, 8, dtype=torch.float64)
        torch.testing.assert_close(model(x), trained(x), rtol=0, atol=0)
        for linear in _linears(model):
            assert linear.weight is linear.basic_ops[0].weight

    def test_to_empty_then_reset(self):
        lin = ops.Linear(8, 4, device="meta")
        params = list(lin.parameters())
        lin.to_empty(device="cpu")
        lin.reset_parameters()
        assert all(a is b for a, b in zip(params, lin.parameters()))
        assert lin.weight.device.type == "cpu" and lin.weight is lin.basic_ops[0].weight
        assert torch.equal(lin.bias.detach(), torch.zeros(4))
        lin(torch.randn(2, 8)).sum().backward()
        assert lin.weight.grad is not None

    def test_replaced_parameter_receives_gradient(self):
        lin = ops.Linear(8, 4, device="meta")
        x = torch.randn(2, 8)
        lin(x).sum().backward()
        new = torch.nn.Parameter(torch.randn(4, 8))
        lin.weight = new
        assert lin.weight is new and lin.basic_ops[0].weight is new
        y = lin(x)
        torch.testing.assert_close(y, x @ new.T + lin.bias)
        y.sum().backward()
        torch.testing.assert_close(new.grad, torch.ones(2, 4).T @ x)

    def test_replaced_parameter_in_a_sequential(self):
        seq = ops.Sequential(ops.Bias(4, device="meta"), ops.GELU())
        x = torch.randn(3, 4)
        seq(x)
        new = torch.nn.Parameter(torch.randn(4))
        seq[0].bias = new
        seq(x).sum().backward()
        assert new.grad is not None

    def test_wrong_shape_replacement_is_rejected(self):
        b = ops.Bias(4, device="cpu")
        with pytest.raises(RuntimeError, match="expected parameter 'bias' of shape"):
            b.bias = torch.nn.Parameter(torch.zeros(5))
        assert b.bias.shape == (4,)

"""The built-in fused ops: for each, the plan names it, and outputs and every gradient match a plain
PyTorch float64 reference; each declines when its conditions fail; the in-place semantics of
AddExtraInput / MakeExtraOutput (te.ops' test_add_extra_input ground)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, OpLog, assert_close_to_ref, cuda_only, randomized
from fusible import ops

D = torch.float64
# fp16 and bf16 too: a fused op rounds each result once, from fp32, against the float64 reference
# (its CPU path rounded intermediates twice: up to 0.025 off).
DTYPES = [D, torch.float32, torch.bfloat16, torch.float16]
# Where an unfused op boundary or a saved pre-activation rounds to fp16/bf16 inside the chain
# (GELU's derivative of a rounded pre, Bias before an activation), the float64 reference of the
# whole chain is not a single rounding away: those cases run in float64 and float32 only.
HIGH_DTYPES = [D, torch.float32]


def _randomize(model):
    """Random parameters (never the zeros / ones of the default init)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def _act(kind):
    return {"gelu": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}[kind]


def _check(
    ops_list,
    ref_fn,
    n_extra_in,
    forward,
    backward,
    device="cpu",
    dtype=D,
    shape=(6, 16),
    dy_cols=None,
):
    """Runs ops_list in one OperationFuser against ref_fn(x, extras, params) -> outputs in float64
    on the same values; checks the plan and every gradient (input, extra inputs, parameters) with
    the tolerance of dtype."""
    for op in ops_list:
        if any(True for _ in op.parameters()):
            op.to(device=device, dtype=dtype)
        _randomize(op)
    fuser = ops.OperationFuser(ops_list)
    torch.manual_seed(2)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    extras = [torch.randn(*shape[:-1], dy_cols or shape[-1], device=device, dtype=dtype)]
    extras = [e.requires_grad_() for e in extras[:n_extra_in]]
    params = [p for op in ops_list for p in op.parameters()]
    # The reference sees float64 copies: an in-place fused add writes into the extra tensors.
    x_ref = x.detach().to(D, copy=True).requires_grad_()
    extras_ref = [e.detach().to(D, copy=True).requires_grad_() for e in extras]
    params_ref = [p.detach().to(D, copy=True).requires_grad_() for p in params]
    # Non-leaf copies of the extras: an in-place add refuses a leaf that requires grad, as torch.
    out = fuser(x, *[e.clone() for e in extras])
    out = list(out) if isinstance(out, tuple) else [out]
    ref = ref_fn(x_ref, extras_ref, params_ref)
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    plan = fuser.fusion_plan()[0]
    assert plan["forward"] == forward and plan["backward"] == backward, plan
    for a, b in zip(out, ref, strict=True):
        assert_close_to_ref(a, b, dtype, gemm=True)
    dys = [torch.randn_like(o) for o in out]
    grads = torch.autograd.grad(out, [x, *extras, *params], dys)
    grads_ref = torch.autograd.grad(
        ref, [x_ref, *extras_ref, *params_ref], [d.double() for d in dys]
    )
    for g, r in zip(grads, grads_ref, strict=True):
        assert_close_to_ref(g, r, dtype, gemm=True)
    return fuser


class TestForwardFusions:
    @pytest.mark.parametrize("dtype", HIGH_DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("kind", ["gelu", "relu"])
    def test_linear_bias_activation(self, kind, device, dtype):
        act = ops.GELU() if kind == "gelu" else ops.ReLU()
        fuser = _check(
            [ops.Linear(16, 8), act],
            lambda x, e, p: _act(kind)(F.linear(x, p[0], p[1])),
            0,
            ["ForwardLinearBiasActivation"],
            ["BasicLinear", "BackwardActivationBias"],
            device=device,
            dtype=dtype,
        )
        fused = fuser.forward_ops()[0][0]
        assert isinstance(fused, ops.fused.ForwardLinearBiasActivation)
        assert isinstance(fused.basic_ops, torch.nn.ModuleList) and fused.basic_ops[2] is act

    def test_linear_bias_without_activation(self):
        _check(
            [ops.Linear(16, 8), ops.Identity()],
            lambda x, e, p: F.linear(x, p[0], p[1]),
            0,
            ["ForwardLinearBiasActivation", "Identity"],
            ["BasicLinear", "Bias", "Identity"],
        )

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("bias", [True, False])
    @pytest.mark.parametrize("in_place", [True, False])
    def test_linear_bias_add(self, bias, in_place, device, dtype):
        linear = ops.Linear(16, 16, bias=bias)
        fwd = "ForwardLinearBiasAdd" if in_place else "ForwardLinearBiasAddOutOfPlace"
        _check(
            [linear, ops.AddExtraInput(in_place=in_place)],
            lambda x, e, p: F.linear(x, p[0], p[1] if bias else None) + e[0],
            1,
            [fwd],
            ["BasicLinear", "Bias", "AddExtraInput"] if bias else ["BasicLinear", "AddExtraInput"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    def test_linear_scale_add(self, device, dtype):
        _check(
            [ops.BasicLinear(16, 16), ops.ConstantScale(-0.5), ops.AddExtraInput(in_place=True)],
            lambda x, e, p: -0.5 * F.linear(x, p[0]) + e[0],
            1,
            ["ForwardLinearScaleAdd"],
            ["BackwardLinearScale", "AddExtraInput"],
            device=device,
            dtype=dtype,
        )

    def test_in_place_add_writes_into_the_callers_tensor(self):
        linear = ops.Linear(8, 8, dtype=D, device="cpu")
        fuser = ops.OperationFuser([linear, ops.AddExtraInput(in_place=True)])
        x, r = torch.randn(3, 8, dtype=D), torch.randn(3, 8, dtype=D)
        expected = F.linear(x, linear.weight, linear.bias) + r
        y = fuser(x, r)
        assert y.data_ptr() == r.data_ptr()  # the sum is in r's storage
        torch.testing.assert_close(r, expected)
        torch.testing.assert_close(y, expected)


class TestBackwardFusions:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    def test_linear_add(self, device, dtype):
        _check(
            [ops.MakeExtraOutput(in_place=True), ops.BasicLinear(16, 8)],
            lambda x, e, p: (F.linear(x, p[0]), x),
            0,
            ["MakeExtraOutput", "BasicLinear"],
            ["BackwardLinearAdd"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    def test_linear_scale(self, device, dtype):
        _check(
            [ops.BasicLinear(16, 8), ops.ConstantScale(0.75)],
            lambda x, e, p: 0.75 * F.linear(x, p[0]),
            0,
            ["BasicLinear", "ConstantScale"],
            ["BackwardLinearScale"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", HIGH_DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("kind", ["gelu", "relu"])
    def test_activation_bias(self, kind, device, dtype):
        act = ops.GELU() if kind == "gelu" else ops.ReLU()
        _check(
            [ops.Identity(), ops.Bias(16), act],
            lambda x, e, p: _act(kind)(x + p[0]),
            0,
            ["Identity", "Bias", kind.upper() if kind == "gelu" else "ReLU"],
            ["Identity", "BackwardActivationBias"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", HIGH_DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("kind", ["gelu", "relu"])
    def test_linear_activation_bias(self, kind, device, dtype):
        act = ops.GELU() if kind == "gelu" else ops.ReLU()
        _check(
            [ops.Bias(16), act, ops.BasicLinear(16, 8)],
            lambda x, e, p: F.linear(_act(kind)(x + p[0]), p[1]),
            0,
            ["Bias", act._cpp.type_name, "BasicLinear"],
            ["BackwardLinearActivationBias"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("zero_centered_gamma", [False, True])
    def test_add_rmsnorm(self, zero_centered_gamma, device, dtype):
        norm = ops.RMSNorm(16, zero_centered_gamma=zero_centered_gamma)

        def ref(x, e, p):
            w = p[0] + 1 if zero_centered_gamma else p[0]
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, x

        _check(
            [ops.MakeExtraOutput(), norm],
            ref,
            0,
            ["MakeExtraOutput", "RMSNorm"],
            ["BackwardAddRMSNorm"],
            device=device,
            dtype=dtype,
        )

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("zero_centered_gamma", [False, True])
    def test_add_layernorm(self, zero_centered_gamma, device, dtype):
        norm = ops.LayerNorm(16, zero_centered_gamma=zero_centered_gamma)

        def ref(x, e, p):
            w = p[0] + 1 if zero_centered_gamma else p[0]
            mu = x.mean(-1, keepdim=True)
            var = (x - mu).pow(2).mean(-1, keepdim=True)
            return (x - mu) * torch.rsqrt(var + 1e-5) * w + p[1], x

        _check(
            [ops.MakeExtraOutput(), norm],
            ref,
            0,
            ["MakeExtraOutput", "LayerNorm"],
            ["BackwardAddLayerNorm"],
            device=device,
            dtype=dtype,
        )

    def test_mlp_block_plan(self):
        make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
        make.set_extra_output_channel(0, "residual", output_to_caller=False)
        add.set_extra_input_channel(0, "residual")
        seq = ops.Sequential(
            make,
            ops.RMSNorm(8, dtype=D, device="cpu"),
            ops.Linear(8, 16, dtype=D, device="cpu"),
            ops.GELU(),
            ops.Linear(16, 8, dtype=D, device="cpu"),
            add,
        )
        seq(torch.randn(3, 8, dtype=D, requires_grad=True)).sum().backward()
        assert seq.fusion_plan() == [
            {
                "forward": [
                    "MakeExtraOutput",
                    "RMSNorm",
                    "ForwardLinearBiasActivation",
                    "ForwardLinearBiasAddOutOfPlace",
                ],
                "backward": [
                    "BackwardAddRMSNorm",
                    "BasicLinear",
                    "BackwardLinearActivationBias",
                    "Bias",
                    "AddExtraInput",
                ],
            }
        ]


class TestDeclines:
    def test_bias_in_another_dtype(self):
        linear = ops.BasicLinear(8, 4, dtype=D, device="cpu")
        bias = ops.Bias(4, dtype=torch.float32, device="cpu")
        fuser = ops.OperationFuser([linear, bias])
        fuser(torch.randn(2, 8, dtype=D))
        assert fuser.fusion_plan()[0]["forward"] == ["BasicLinear", "Bias"]

    def test_add_not_in_place_keeps_its_input(self):
        # te.ops leaves this pair unfused; ours fuses it without writing into the extra tensor.
        fuser = ops.OperationFuser([ops.Linear(8, 8, dtype=D, device="cpu"), ops.AddExtraInput()])
        extra = torch.randn(2, 8, dtype=D)
        before = extra.clone()
        y = fuser(torch.randn(2, 8, dtype=D), extra)
        assert fuser.fusion_plan()[0]["forward"] == ["ForwardLinearBiasAddOutOfPlace"]
        assert torch.equal(extra, before) and y.data_ptr() != extra.data_ptr()

    def test_make_extra_output_in_place_is_not_add_rmsnorm(self):
        fuser = ops.OperationFuser(
            [ops.MakeExtraOutput(in_place=True), ops.RMSNorm(8, dtype=D, device="cpu")]
        )
        y, extra = fuser(torch.randn(2, 8, dtype=D, requires_grad=True))
        (y.sum() + extra.sum()).backward()
        assert fuser.fusion_plan()[0]["backward"] == ["MakeExtraOutput", "RMSNorm"]

    def test_make_extra_output_not_in_place_is_not_linear_add(self):
        fuser = ops.OperationFuser(
            [ops.MakeExtraOutput(), ops.BasicLinear(8, 4, dtype=D, device="cpu")]
        )
        y, extra = fuser(torch.randn(2, 8, dtype=D, requires_grad=True))
        (y.sum() + extra.sum()).backward()
        assert fuser.fusion_plan()[0]["backward"] == ["MakeExtraOutput", "BasicLinear"]

    def test_no_backward_fusion_where_the_backward_does_not_run(self):
        bias = ops.Bias(8, dtype=D, device="cpu")
        bias.bias.requires_grad_(False)
        fuser = ops.OperationFuser([bias, ops.GELU(), ops.BasicLinear(8, 4, dtype=D, device="cpu")])
        fuser(torch.randn(2, 8, dtype=D)).sum().backward()  # only the linear's weight needs a grad
        assert fuser.fusion_plan()[0]["backward"] == ["Bias", "GELU", "BasicLinear"]

    def test_other_activations_stay_unfused(self):
        fuser = ops.OperationFuser([ops.Linear(8, 4, dtype=D, device="cpu"), ops.SiLU()])
        fuser(torch.randn(2, 8, dtype=D, requires_grad=True)).sum().backward()
        plan = fuser.fusion_plan()[0]
        assert plan == {
            "forward": ["ForwardLinearBiasActivation", "SiLU"],
            "backward": ["BasicLinear", "Bias", "SiLU"],
        }


class TestInPlaceSemantics:
    """te.ops' test_add_extra_input ground: values, exact gradients, storage identity."""

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("in_place", [False, True])
    def test_add_extra_input(self, in_place, device):
        x1 = torch.randn(32, 32, dtype=D, device=device, requires_grad=True)
        x2 = torch.randn(32, 32, dtype=D, device=device, requires_grad=True)
        expected = x1.detach() + x2.detach()
        extra = x2 * 1  # not a leaf: an in-place add refuses a leaf that requires grad
        y = ops.AddExtraInput(in_place=in_place)(x1, extra)
        torch.testing.assert_close(y, expected)
        assert (y.data_ptr() == extra.data_ptr()) == in_place
        dy = torch.randn_like(y)
        y.backward(dy)
        torch.testing.assert_close(x1.grad, dy, rtol=0, atol=0)
        torch.testing.assert_close(x2.grad, dy, rtol=0, atol=0)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("in_place", [False, True])
    @pytest.mark.parametrize("x_dtype,extra_dtype", [(torch.float32, D), (D, torch.float32)])
    def test_add_extra_input_promotes_as_torch(self, x_dtype, extra_dtype, in_place, device):
        """Out of place y = x + extra in torch's promoted dtype (te.ops adds with `+`); in place,
        extra's storage and dtype. Each gradient comes back in its tensor's dtype."""
        x = torch.randn(4, 8, dtype=x_dtype, device=device, requires_grad=True)
        extra = torch.randn(4, 8, dtype=extra_dtype, device=device, requires_grad=not in_place)
        expected = x.detach() + extra.detach() if not in_place else extra.detach() + x.detach()
        y = ops.AddExtraInput(in_place=in_place)(x, extra if not in_place else extra.clone())
        want = extra_dtype if in_place else torch.promote_types(x_dtype, extra_dtype)
        assert y.dtype == want
        torch.testing.assert_close(y, expected.to(want), rtol=0, atol=0)
        dy = torch.randn_like(y)
        y.backward(dy)
        assert x.grad.dtype == x_dtype
        torch.testing.assert_close(x.grad, dy.to(x_dtype), rtol=0, atol=0)
        if not in_place:
            assert extra.grad.dtype == extra_dtype
            torch.testing.assert_close(extra.grad, dy.to(extra_dtype), rtol=0, atol=0)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("in_place", [True, False])
    @pytest.mark.parametrize("view", [False, True], ids=["write", "view"])
    def test_a_zero_dim_input_adds_as_torch_does(self, device, in_place, view):
        """A 0-dim float32 x onto a bf16 extra: torch's extra += x (in_place, te.ops') and x +
        extra both round x to bf16 first (a 0-dim tensor takes no part in type promotion); the
        in-place add used x unrounded (other bits in most elements). Its gradient: torch's."""
        torch.manual_seed(3)
        x = (torch.randn((), device=device) * 3).requires_grad_(view)
        extra = torch.randn(64, dtype=torch.bfloat16, device=device) * 3
        want = extra.clone()
        want += x.detach()
        base = torch.zeros(2, 64, dtype=torch.bfloat16, device=device)
        base[0] = extra
        target = base[0] if view else base[0].clone()
        y = ops.AddExtraInput(in_place=in_place)(x, target)
        assert y.dtype == torch.bfloat16 and torch.equal(y, want)
        if view:  # not written while autograd records; x's gradient is torch's (a bf16 sum)
            dy = torch.randn_like(y)
            y.backward(dy)
            xr = x.detach().clone().requires_grad_()
            (xr + extra).backward(dy)
            assert torch.equal(base[0], extra) and x.grad.dtype == torch.float32
            assert torch.equal(x.grad, xr.grad), (x.grad, xr.grad)
        elif in_place:
            assert torch.equal(target, want)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("where", ["view", "channel", "extra_is_input"])
    @pytest.mark.parametrize(
        "x_dtype,extra_dtype",
        [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16), (D, D)],
    )
    def test_in_place_add_done_out_of_place_matches_the_write(
        self, x_dtype, extra_dtype, where, device
    ):
        """Where in_place=True cannot write (a view while autograd records, a channel's value, the
        input itself) it adds out of place with the write's dtype and bits: torch's extra += x,
        rounded once to extra's dtype (was: the promoted dtype, float32 for bf16 + fp16)."""
        torch.manual_seed(0)
        x = torch.randn(4, 8, dtype=x_dtype, device=device) * 3
        extra = torch.randn(4, 8, dtype=extra_dtype, device=device) * 3
        want = extra.clone()
        want += x  # the write in_place=True does where it can
        xg = x.clone().requires_grad_()
        if where == "view":
            base = torch.zeros(4, 16, dtype=extra_dtype, device=device)
            base[:, :8] = extra
            y = ops.AddExtraInput(in_place=True)(xg, base[:, :8])
            assert torch.equal(base[:, :8], extra)  # not written: a view while autograd records
        else:
            if x_dtype == extra_dtype:
                pytest.skip("one dtype: the GEMM adds the residual in its epilogue (other bits)")
            # The residual stream is extra (its dtype), the block a Linear in x's dtype; the
            # residual comes through a channel, or as the call's extra input that is its input.
            linear = randomized(ops.Linear(8, 8, dtype=x_dtype, device=device))
            add = ops.AddExtraInput(in_place=True)
            if where == "channel":
                make = ops.MakeExtraOutput().set_extra_output_channel(
                    0, "r", output_to_caller=False
                )
                seq = ops.Sequential(make, linear, add.set_extra_input_channel(0, "r"))
            else:
                seq = ops.Sequential(linear, add)
            xg = extra.clone().requires_grad_()
            with torch.no_grad():
                want = extra.clone()
                want += linear(extra)
            y = seq(xg) if where == "channel" else seq(xg, xg)
        assert y.dtype == want.dtype and torch.equal(y, want), (y.dtype, want.dtype)
        dy = torch.randn_like(y)
        y.backward(dy)
        assert xg.grad.dtype == xg.dtype
        if where == "view":  # d(x + extra)/dx: dy, in x's dtype
            torch.testing.assert_close(xg.grad, dy.to(x_dtype), rtol=0, atol=0)

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize(
        "x_dtype,extra_dtype",
        [
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32),
            (torch.float16, torch.float64),
            (torch.bfloat16, torch.float16),
        ],
    )
    def test_mixed_dtype_add_converts_inside_the_add(self, x_dtype, extra_dtype, device):
        """The narrower operand converts inside the one add kernel, not in a cast kernel first (a
        bf16 block output onto an fp32 residual stream: no extra pass over the activation). Where
        the sum's dtype is neither operand's (bf16 + fp16), both are cast first."""
        x = torch.randn(64, 32, dtype=x_dtype, device=device)
        extra = torch.randn(64, 32, dtype=extra_dtype, device=device)
        with OpLog() as log, torch.profiler.profile() as prof:
            y = ops.AddExtraInput()(x, extra)
        want = torch.promote_types(x_dtype, extra_dtype)
        if want in (x_dtype, extra_dtype):
            # fusible's add takes both tensors as they are, the one in the sum's dtype first.
            other = extra_dtype if want == x_dtype else x_dtype
            assert log.calls == [("fusible.add_fwd", (want, other))], log.calls
            if device == "cuda":  # (ATen's CPU add converts through a copy of its own)
                names = [e.name for e in prof.events()]
                assert "aten::_to_copy" not in names, names
        else:
            # (in either order: C++ leaves the order of a call's arguments open)
            casts = sorted(log.calls[:2], key=str)
            assert casts == sorted([("aten.to", (x_dtype,)), ("aten.to", (extra_dtype,))], key=str)
            assert log.calls[2:] == [("fusible.add_fwd", (want, want))], log.calls
        assert y.dtype == want and torch.equal(y, x + extra)

    @pytest.mark.parametrize("bias", [False, True])
    def test_bf16_block_output_added_to_a_float32_residual_stays_float32(self, bias):
        """A Linear in bf16 then AddExtraInput with an fp32 residual (fused as
        ForwardLinearBiasAdd where dtypes agree): y is fp32, the residual is not rounded to bf16,
        and three SGD steps match the same model in plain torch."""
        torch.manual_seed(0)
        linear = ops.Linear(8, 8, bias=bias, dtype=torch.bfloat16, device="cpu")
        with torch.no_grad():
            for p in linear.parameters():
                p.uniform_(-0.5, 0.5)
        ref = {
            n: p.detach().double().clone().requires_grad_() for n, p in linear.named_parameters()
        }
        seq = ops.Sequential(linear, ops.AddExtraInput())
        opt = torch.optim.SGD(seq.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.values(), lr=0.1)
        for _ in range(3):
            x = torch.randn(4, 8, dtype=torch.bfloat16)
            residual = (torch.randn(4, 8) + 1000.0).requires_grad_()  # bf16 would round it
            y = seq(x, residual)
            assert y.dtype == torch.float32
            # The linear's output rounds to bf16 (ulp <= 2^-6 here); the residual, near 1000, would
            # round by up to 2 in bf16.
            with torch.no_grad():
                torch.testing.assert_close(y, linear(x).float() + residual, rtol=0, atol=2**-5)
            h = x.double() @ ref["weight"].T + (ref["bias"] if bias else 0)
            torch.testing.assert_close(y.double(), h + residual.double(), rtol=0, atol=2**-5)
            dy = torch.randn_like(y)
            opt.zero_grad()
            y.backward(dy)
            torch.testing.assert_close(residual.grad, dy, rtol=0, atol=0)
            (h * dy.double()).sum().backward()
            opt.step()
            ref_opt.step()
            ref_opt.zero_grad()
            for n, p in linear.named_parameters():
                # bf16 gradients: lr x one bf16 ulp of a gradient of up to ~5.
                torch.testing.assert_close(p.double(), ref[n].detach(), rtol=2**-7, atol=5e-3)
                with torch.no_grad():
                    ref[n].copy_(p.double())  # bf16 parameters: continue from the same bits

    @pytest.mark.parametrize("in_place", [False, True])
    def test_make_extra_output(self, in_place):
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        y, extra = ops.MakeExtraOutput(in_place=in_place)(x)
        assert y.data_ptr() == x.data_ptr() and extra.data_ptr() == x.data_ptr()
        dy, de = torch.randn_like(y), torch.randn_like(extra)
        torch.autograd.backward([y, extra], [dy, de])
        torch.testing.assert_close(x.grad, dy + de, rtol=0, atol=0)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mlp_fused_matches_unfused_on_cuda(dtype):
    """The cuBLASLt epilogues (GELU aux, GELU gradient + bias gradient, residual) end to end:
    the fused plan against the same model with every fusion removed, in 16-bit on the GPU."""

    def build():
        torch.manual_seed(0)
        seq = ops.Sequential(
            ops.RMSNorm(64, device="cuda", dtype=dtype),
            ops.Linear(64, 128, device="cuda", dtype=dtype),
            ops.GELU(),
            ops.Linear(128, 64, device="cuda", dtype=dtype),
            ops.AddExtraInput(in_place=True),
        )
        _randomize(seq)
        return seq

    def run(seq):
        torch.manual_seed(3)
        x = torch.randn(32, 64, device="cuda", dtype=dtype, requires_grad=True)
        r = torch.randn(32, 64, device="cuda", dtype=dtype)
        y = seq(x, r)
        grads = torch.autograd.grad(y, [x, *seq.parameters()], torch.ones_like(y))
        return [y.float(), *[g.float() for g in grads]]

    fused_model, plain_model = build(), build()
    fused = run(fused_model)
    plan = fused_model.fusion_plan()[0]
    assert plan["forward"][1:] == ["ForwardLinearBiasActivation", "ForwardLinearBiasAdd"]
    assert "BackwardLinearActivationBias" in plan["backward"]
    snap = ops.snapshot_fusions()
    ops.restore_fusions(([], {}))
    try:
        plain = run(plain_model)
        assert plain_model.fusion_plan()[0]["forward"][1] == "BasicLinear"
    finally:
        ops.restore_fusions(snap)
    for a, b in zip(fused, plain, strict=True):
        scale = b.abs().max().clamp_min(1e-3)
        assert (a - b).abs().max() <= 3e-2 * scale


class TestFusedEdgeCases:
    def _unfused(self, fn):
        snap = ops.snapshot_fusions()
        ops.restore_fusions(([], {}))
        try:
            return fn()
        finally:
            ops.restore_fusions(snap)

    @pytest.mark.parametrize("norm", ["rmsnorm", "linear"])
    def test_autocast_residual_gradient_matches_unfused(self, norm):
        def run():
            torch.manual_seed(0)
            second = (
                ops.RMSNorm(16, device="cpu")
                if norm == "rmsnorm"
                else ops.BasicLinear(16, 8, device="cpu")
            )
            make = ops.MakeExtraOutput(in_place=norm == "linear")
            fuser = ops.OperationFuser([make, second])
            _randomize(second)
            x = torch.randn(4, 16, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, extra = fuser(x)
            (y.float().square().sum() + extra.float().sum()).backward()
            return fuser.fusion_plan()[0]["backward"], x.grad

        plan, fused = run()
        assert plan == ["BackwardAddRMSNorm" if norm == "rmsnorm" else "BackwardLinearAdd"]
        _, plain = self._unfused(run)
        # Mixed dtypes: the fused op adds in the input's dtype, exactly as the unfused ops do.
        torch.testing.assert_close(fused, plain, rtol=0, atol=0)

    def test_in_place_add_into_a_saved_tensor_is_detected(self):
        r = torch.randn(3, 8, dtype=D, requires_grad=True) * 1
        z = r * r  # saves r
        ops.AddExtraInput(in_place=True)(torch.randn(3, 8, dtype=D), r)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()

    @pytest.mark.parametrize("device", DEVICES)
    def test_extra_sharing_memory_with_the_input_is_added_out_of_place(self, device):
        linear = ops.Linear(16, 16, dtype=torch.float32, device=device)
        _randomize(linear)
        fuser = ops.OperationFuser([linear, ops.AddExtraInput(in_place=True)])
        x = torch.randn(4, 16, device=device)
        expected = F.linear(x, linear.weight, linear.bias) + x
        y = fuser(x, x.view(4, 16))  # another tensor over x's memory
        torch.testing.assert_close(y, expected, rtol=1e-3, atol=1e-5)
        assert fuser.fusion_plan()[0]["forward"] == ["ForwardLinearBiasAdd"]

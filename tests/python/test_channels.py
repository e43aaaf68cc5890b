"""Named extra-tensor channels: routing, gradients, validation, wiring errors, locking,
cross-group routing and named inputs/outputs. Every case checks values and gradients against plain
PyTorch."""

import gc

import pytest
import torch
from fusible import ops

D = torch.float64


def _x(*shape, grad=True):
    return torch.randn(*shape, dtype=D, requires_grad=grad)


def _bias(n=4):
    b = ops.Bias(n, device="cpu", dtype=D)
    with torch.no_grad():
        b.bias.copy_(torch.randn(n, dtype=D))
    return b


def _grads(y, inputs, dy=None):
    return torch.autograd.grad(
        y, inputs, dy if dy is not None else torch.ones_like(y), allow_unused=True
    )


class TestRouting:
    def test_internal_residual(self):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
        bias = _bias()
        add = ops.AddExtraInput().set_extra_input_channel(0, "res")
        fuser = ops.OperationFuser([make, bias, add])
        assert fuser.num_extra_inputs == 0
        assert fuser.extra_input_sources() == [[], [], [(0, 0)]]
        x = _x(3, 4)
        y = fuser(x)
        xr = x.detach().requires_grad_()
        ref = (xr + bias.bias) + xr
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        g = _grads(y, [x, bias.bias])
        gr = _grads(ref, [xr, bias.bias])
        for a, b in zip(g, gr):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    @pytest.mark.parametrize("input_grad", [True, False])
    def test_fan_out_sums_gradients(self, input_grad):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "h", output_to_caller=False)
        scale = ops.ConstantScale(3.0)
        add1 = ops.AddExtraInput().set_extra_input_channel(0, "h")
        bias = _bias()
        add2 = ops.AddExtraInput().set_extra_input_channel(0, "h")
        fuser = ops.OperationFuser([make, scale, add1, bias, add2])
        x = _x(2, 4, grad=input_grad)
        y = fuser(x)
        xr = x.detach().requires_grad_(input_grad)
        ref = (3 * xr + xr + bias.bias) + xr
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        inputs = [x, bias.bias] if input_grad else [bias.bias]
        refs_in = [xr, bias.bias] if input_grad else [bias.bias]
        for a, b in zip(_grads(y, inputs, dy), _grads(ref, refs_in, dy)):
            torch.testing.assert_close(a, b)
        if input_grad:
            torch.testing.assert_close(_grads(fuser(x), [x], dy)[0], 5 * dy)

    def test_hidden_and_public_outputs_mixed(self):
        m1 = ops.MakeExtraOutput()  # public, unnamed
        m2 = ops.MakeExtraOutput().set_extra_output_channel(0, "hidden", output_to_caller=False)
        s = ops.ConstantScale(2.0)
        m3 = ops.MakeExtraOutput().set_extra_output_channel(0, "shown")  # public and named
        add = ops.AddExtraInput().set_extra_input_channel(0, "hidden")
        fuser = ops.OperationFuser([m1, m2, s, m3, add])
        x = _x(5)
        y, e1, e3 = fuser(x)
        torch.testing.assert_close(e1, x, rtol=0, atol=0)
        torch.testing.assert_close(e3, 2 * x, rtol=0, atol=0)
        torch.testing.assert_close(y, 3 * x, rtol=0, atol=0)
        dy, d1, d3 = torch.randn(5, dtype=D), torch.randn(5, dtype=D), torch.randn(5, dtype=D)
        (gx,) = torch.autograd.grad([y, e1, e3], [x], [dy, d1, d3])
        torch.testing.assert_close(gx, 2 * dy + dy + d1 + 2 * d3)

    @pytest.mark.parametrize("to_caller", [True, False])
    def test_unconsumed_named_output(self, to_caller):
        make = ops.MakeExtraOutput().set_extra_output_channel(
            0, "lonely", output_to_caller=to_caller
        )
        fuser = ops.OperationFuser([make, ops.ConstantScale(2.0)])
        x = _x(3)
        out = fuser(x)
        if to_caller:
            y, e = out
            torch.testing.assert_close(e, x, rtol=0, atol=0)
        else:
            y = out
            assert isinstance(y, torch.Tensor)
        torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)

    def test_public_and_bound_inputs_mixed(self):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "a", output_to_caller=False)
        add_public = ops.AddExtraInput()
        add_bound = ops.AddExtraInput().set_extra_input_channel(0, "a")
        add_public2 = ops.AddExtraInput()
        fuser = ops.OperationFuser([make, add_public, add_bound, add_public2])
        assert fuser.num_extra_inputs == 2
        x, r1, r2 = _x(4), _x(4), _x(4)
        y = fuser(x, r1, r2)
        torch.testing.assert_close(y, x + r1 + x + r2, rtol=0, atol=0)
        dy = torch.randn(4, dtype=D)
        gx, g1, g2 = torch.autograd.grad(y, [x, r1, r2], dy)
        torch.testing.assert_close(gx, 2 * dy, rtol=0, atol=0)
        torch.testing.assert_close(g1, dy, rtol=0, atol=0)
        torch.testing.assert_close(g2, dy, rtol=0, atol=0)

    def test_scaled_swiglu_scales_by_name_get_gradients(self):
        swiglu = ops.ScaledSwiGLU().set_extra_input_channel(0, "scales")
        seq = ops.Sequential(ops.Identity(), swiglu)
        x, scales = _x(3, 8), _x(3)
        y = seq(x, channel_inputs={"scales": scales})
        xr, sr = x.detach().requires_grad_(), scales.detach().requires_grad_()
        a, b = xr.chunk(2, -1)
        ref = sr.unsqueeze(-1) * torch.nn.functional.silu(a) * b
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        for g, r in zip(
            torch.autograd.grad(y, [x, scales], dy), torch.autograd.grad(ref, [xr, sr], dy)
        ):
            torch.testing.assert_close(g, r)


class TestValidation:
    def test_setter_errors(self):
        add = ops.AddExtraInput()
        make = ops.MakeExtraOutput()
        with pytest.raises(IndexError, match="out of range"):
            add.set_extra_input_channel(1, "a")
        with pytest.raises(IndexError, match="out of range"):
            add.set_extra_input_channel(-1, "a")
        with pytest.raises(IndexError, match="out of range"):
            make.set_extra_output_channel(2, "a")
        with pytest.raises(IndexError, match="out of range"):
            ops.GELU().set_extra_input_channel(0, "a")
        for bad in ("", 3, b"a"):
            with pytest.raises(ValueError, match="non-empty string"):
                add.set_extra_input_channel(0, bad)
            with pytest.raises(ValueError, match="non-empty string"):
                make.set_extra_output_channel(0, bad)
        with pytest.raises(TypeError, match="output_to_caller must be a bool"):
            make.set_extra_output_channel(0, "a", output_to_caller=1)
        assert add.set_extra_input_channel(0, None) is add
        assert make.set_extra_output_channel(0, "a").set_extra_output_channel(0, None) is make
        assert make._cpp.extra_output_channels() == [(None, True)]

    def test_wiring_errors(self):
        def m(name, to_caller=True):
            return ops.MakeExtraOutput().set_extra_output_channel(
                0, name, output_to_caller=to_caller
            )

        def a(name):
            return ops.AddExtraInput().set_extra_input_channel(0, name)

        with pytest.raises(ValueError, match="'r' has multiple producers.*op 0.*op 1"):
            ops.OperationFuser([m("r"), m("r")])
        with pytest.raises(ValueError, match="'r'.*AddExtraInput \\(op 0\\).*has no producer"):
            ops.OperationFuser([a("r")])
        with pytest.raises(
            ValueError, match="'r'.*AddExtraInput \\(op 0\\).*has no earlier producer"
        ):
            ops.OperationFuser([a("r"), m("r")])
        seq = ops.Sequential(a("q"), ops.Identity())
        with pytest.raises(ValueError, match="has no producer"):
            seq(_x(3))
        with pytest.raises(ValueError, match="multiple producers"):
            ops.Sequential(m("z"), torch.nn.Tanh(), m("z"))(_x(3))
        with pytest.raises(ValueError, match="has no earlier producer"):
            ops.Sequential(a("w"), torch.nn.Tanh(), m("w"))(_x(3))

    def test_rebinding_before_capture_keeps_last_binding(self):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "first", output_to_caller=False)
        make.set_extra_output_channel(0, "second", output_to_caller=False)
        add = (
            ops.AddExtraInput()
            .set_extra_input_channel(0, "first")
            .set_extra_input_channel(0, "second")
        )
        x = _x(3)
        y = ops.OperationFuser([make, add])(x)
        torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)

    def test_call_then_bind(self):
        make = ops.MakeExtraOutput()
        x = _x(3)
        y, e = make(x)  # a plain call never locks
        assert not make.channels_locked
        make.set_extra_output_channel(0, "e", output_to_caller=False)
        y2 = make(x)  # the throw-away fuser re-routes: the output is hidden now
        assert isinstance(y2, torch.Tensor)
        torch.testing.assert_close(y2, x, rtol=0, atol=0)

    def test_lock_while_alive_and_release(self):
        make = ops.MakeExtraOutput()
        fuser = ops.OperationFuser([make])
        assert make.channels_locked
        with pytest.raises(RuntimeError, match="already captured its channel routing"):
            make.set_extra_output_channel(0, "x")
        del fuser
        gc.collect()
        assert not make.channels_locked
        make.set_extra_output_channel(0, "x")

        seq = ops.Sequential(make, ops.Identity())
        seq(_x(2))
        seq2 = ops.Sequential(make)
        seq2(_x(2))
        assert make.channels_locked
        del seq2
        gc.collect()
        assert make.channels_locked  # still held by seq: holders are counted
        seq.append(ops.Identity())  # changing the structure releases the lock
        assert not make.channels_locked
        seq(_x(2))
        assert make.channels_locked
        del seq
        gc.collect()
        assert not make.channels_locked


class TestSequentialChannels:
    def test_cross_group_routing_through_a_torch_module(self):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
        lin = ops.Linear(4, 4, device="cpu", dtype=D)
        add = ops.AddExtraInput().set_extra_input_channel(0, "res")
        seq = ops.Sequential(make, lin, torch.nn.Tanh(), add)
        x = _x(3, 4)
        y = seq(x)
        assert seq.fusion_plan()[1] == {"module": "Tanh"}
        xr = x.detach().requires_grad_()
        ref = torch.tanh(torch.nn.functional.linear(xr, lin.weight, lin.bias)) + xr
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        for g, r in zip(
            _grads(y, [x, lin.weight, lin.bias], dy), _grads(ref, [xr, lin.weight, lin.bias], dy)
        ):
            torch.testing.assert_close(g, r)

    def test_named_inputs_and_outputs(self):
        add = ops.AddExtraInput().set_extra_input_channel(0, "residual")
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "skip")
        seq = ops.Sequential(add, ops.ConstantScale(2.0), make, ops.ConstantScale(3.0))
        x, r = _x(4), _x(4)
        y, named = seq(x, channel_inputs={"residual": r}, return_dict=True)
        assert set(named) == {"skip"}
        torch.testing.assert_close(named["skip"], 2 * (x + r), rtol=0, atol=0)
        torch.testing.assert_close(y, 6 * (x + r), rtol=0, atol=0)
        dy, ds = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
        gx, gr = torch.autograd.grad([y, named["skip"]], [x, r], [dy, ds])
        torch.testing.assert_close(gx, 6 * dy + 2 * ds)
        torch.testing.assert_close(gr, 6 * dy + 2 * ds)

    def test_named_io_errors(self):
        seq = ops.Sequential(ops.MakeExtraOutput(), ops.Identity())
        with pytest.raises(ValueError, match="every public extra output to be named"):
            seq(_x(2), return_dict=True)
        with pytest.raises(ValueError, match="feed no bound input"):
            seq(_x(2), channel_inputs={"nobody": _x(2)})

    def test_a_channel_made_in_an_earlier_group_is_not_the_callers(self):
        """channel_inputs naming a channel whose producer sits in an earlier fuser group (split by
        a plain module) are refused, as in a model of one group; they were silently unused."""
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
        add = ops.AddExtraInput().set_extra_input_channel(0, "r")
        split = ops.Sequential(make, ops.ConstantScale(2.0), torch.nn.Tanh(), add)
        x = _x(4)
        with pytest.raises(ValueError, match="channel_inputs r feed no bound input"):
            split(x, channel_inputs={"r": _x(4)})
        torch.testing.assert_close(split(x), torch.tanh(2 * x) + x)

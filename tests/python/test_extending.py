"""Extending fusible from Python with te.ops' protocol: custom basic ops, fused ops and fusion
functions, mixed with built-in ops. Every case checks values and gradients against plain PyTorch."""

import warnings

import fusible
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from fusible import ops

D = torch.float64


@pytest.fixture(autouse=True)
def isolated_registry():
    snap = ops.snapshot_fusions()
    yield
    ops.restore_fusions(snap)


class LearnableScale(ops.BasicOperation):
    """y = w * x with a learnable scalar w."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(1.5, dtype=D))

    def op_forward(
        self, ctx, input_, *, prev_op_grad_output_quantizer, next_op_input_quantizer, **unused
    ):
        ctx.save_for_backward(input_)
        return self.weight * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return self.weight * grad_output, [(grad_output * x).sum()]


class FreshScales(ops.BasicOperation):
    """y = x; extra output 0 = a fresh tensor exp(log_s) computed from its own parameter."""

    num_extra_outputs = 1

    def __init__(self, rows):
        super().__init__()
        self.log_s = torch.nn.Parameter(torch.randn(rows, dtype=D) * 0.1)

    def fuser_forward(
        self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs, **unused
    ):
        s = self.log_s.detach().exp()
        basic_op_ctxs[0].save_for_backward(s)
        return input_, [[s]]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (s,) = basic_op_ctxs[0].saved_tensors
        ds = basic_op_grad_extra_outputs[0][0]
        return grad_output, [[None if ds is None else ds * s]], [[]]


def _x(*shape, grad=True):
    return torch.randn(*shape, dtype=D, requires_grad=grad)


class TestCustomBasicOps:
    def test_learnable_scale_gradient_flows_through_the_fuser(self):
        scale = LearnableScale()
        bias = ops.Bias(4, device="cpu", dtype=D)
        seq = ops.Sequential(scale, bias, ops.GELU())
        assert [n for n, _ in seq.named_parameters()] == ["0.weight", "1.bias"]
        x = _x(3, 4)
        y = seq(x)
        xr = x.detach().requires_grad_()
        w = scale.weight.detach().clone().requires_grad_()
        ref = F.gelu(w * xr + bias.bias, approximate="tanh")
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        g = torch.autograd.grad(y, [x, scale.weight, bias.bias], dy)
        r = torch.autograd.grad(ref, [xr, w, bias.bias], dy)
        for a, b in zip(g, r):
            torch.testing.assert_close(a, b)
        assert seq.fusion_plan()[0]["forward"] == ["LearnableScale", "Bias", "GELU"]

    def test_fresh_tensor_producer_feeds_scaled_swiglu(self):
        prod = FreshScales(3).set_extra_output_channel(0, "scales", output_to_caller=False)
        swiglu = ops.ScaledSwiGLU().set_extra_input_channel(0, "scales")
        fuser = ops.OperationFuser([prod, swiglu])
        x = _x(3, 8, grad=False)  # only the producer's parameter needs a gradient
        y = fuser(x)
        log_s = prod.log_s.detach().clone().requires_grad_()
        a, b = x.chunk(2, -1)
        ref = log_s.exp().unsqueeze(-1) * F.silu(a) * b
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        (g,) = torch.autograd.grad(y, [prod.log_s], dy)
        (r,) = torch.autograd.grad(ref, [log_s], dy)
        torch.testing.assert_close(g, r)


class Axpy(ops.FusedOperation):
    """Forward-only fusion of ConstantScale + AddExtraInput: y = a * x + extra."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
        a = self.basic_ops[0].scale
        return a * input_ + basic_op_extra_inputs[1][0], [[], []]


def fuse_axpy(ops_list, *, recipe):
    out, i = [], 0
    while i < len(ops_list):
        if (
            i + 1 < len(ops_list)
            and isinstance(ops_list[i], ops.ConstantScale)
            and isinstance(ops_list[i + 1], ops.AddExtraInput)
        ):
            out.append(Axpy(ops_list[i : i + 2]))
            i += 2
        else:
            out.append(ops_list[i])
            i += 1
    return out


class LinearSiLU(ops.FusedOperation):
    """Forward-only BasicLinear + SiLU; fills both contexts as the unfused forwards would."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        linear, _ = self.basic_ops
        w = linear.weight
        h = input_ @ w.detach().T
        lin_ctx, act_ctx = basic_op_ctxs
        lin_ctx.save_for_backward(input_, w.detach())
        lin_ctx.compute_dtype = w.dtype
        act_ctx.save_for_backward(h)
        act_ctx.compute_dtype = h.dtype
        act_ctx.input_dtype = h.dtype
        return F.silu(h), [[], []]


class LinearThenScale(ops.FusedOperation):
    """Forward-only BasicLinear + ConstantScale; fills the linear's context as its forward would
    (the scale keeps none)."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        linear, scale = self.basic_ops
        w = linear.weight.detach()
        basic_op_ctxs[0].save_for_backward(input_, w)
        basic_op_ctxs[0].compute_dtype = w.dtype
        return scale.scale * (input_ @ w.T), [[], []]


class ScaleThenLinearBackward(ops.FusedOperation):
    """Backward-only [ConstantScale, BasicLinear]: reads what BasicLinear's forward saved."""

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        scale, _ = self.basic_ops
        x, w = basic_op_ctxs[1].saved_tensors
        dw = grad_output.reshape(-1, grad_output.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        dx = scale.scale * (grad_output @ w)
        return dx, [[], [dw]], [[], []]


class JointScales(ops.FusedOperation):
    """Joint fusion of two ConstantScale ops."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        return self._k() * input_, [[], []]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        return self._k() * grad_output, [[], []], [[], []]

    def _k(self):
        return self.basic_ops[0].scale * self.basic_ops[1].scale


def _pairwise(cls, first, second):
    def fusion(ops_list, *, recipe):
        out, i = [], 0
        while i < len(ops_list):
            if (
                i + 1 < len(ops_list)
                and isinstance(ops_list[i], first)
                and isinstance(ops_list[i + 1], second)
            ):
                out.append(cls(ops_list[i : i + 2]))
                i += 2
            else:
                out.append(ops_list[i])
                i += 1
        return out

    fusion.__name__ = f"fuse_{cls.__name__}"
    return fusion


class TestFusedOpsAndFusions:
    def test_forward_only_axpy(self):
        ops.register_forward_fusion(fuse_axpy)
        scale, add = ops.ConstantScale(0.25), ops.AddExtraInput()
        fuser = ops.OperationFuser([ops.Identity(), scale, add])
        x, r = _x(5), _x(5)
        y = fuser(x, r)
        plan = fuser.forward_ops()
        assert isinstance(plan[1][0], Axpy) and plan[1][1] == [1, 2]
        assert list(plan[1][0].basic_ops) == [scale, add]
        assert isinstance(plan[1][0].basic_ops, torch.nn.ModuleList)  # te.ops' layout
        assert fuser.fusion_plan()[0] == {
            "forward": ["Identity", "Axpy"],
            "backward": ["Identity", "ConstantScale", "AddExtraInput"],
        }
        torch.testing.assert_close(y, 0.25 * x + r)
        gx, gr = torch.autograd.grad(y, [x, r], torch.ones(5, dtype=D))
        torch.testing.assert_close(gx, torch.full((5,), 0.25, dtype=D))
        torch.testing.assert_close(gr, torch.ones(5, dtype=D))

    def test_an_unknown_fusion_pass_is_refused(self):
        with pytest.raises(ValueError, match="expected pass 'forward', 'backward' or"):
            fusible._C.register_fusion(lambda ops_list, recipe: ops_list, "fwd", False, "f")

    def test_a_fused_forward_that_saves_too_little_is_named(self):
        class SavesTooLittle(LinearSiLU):
            def fuser_forward(self, basic_op_ctxs, input_, **unused):
                y, extra = super().fuser_forward(basic_op_ctxs, input_, **unused)
                basic_op_ctxs[0].save_for_backward(input_)  # BasicLinear's backward reads (x, w)
                return y, extra

        ops.register_forward_fusion(_pairwise(SavesTooLittle, ops.BasicLinear, ops.SiLU))
        seq = ops.Sequential(ops.BasicLinear(4, 6, device="cpu", dtype=D), ops.SiLU())
        y = seq(_x(3, 4))
        with pytest.raises(
            RuntimeError,
            match=r"BasicLinear: its backward read a saved tensor that the forward did not save "
            r"\(forward ran as SavesTooLittle; tensors saved per basic op: 1\)",
        ):
            y.sum().backward()

    def test_forward_only_linear_silu_backward_unfused(self):
        ops.register_forward_fusion(_pairwise(LinearSiLU, ops.BasicLinear, ops.SiLU))
        lin = ops.BasicLinear(4, 6, device="cpu", dtype=D)
        seq = ops.Sequential(lin, ops.SiLU())
        x = _x(3, 4)
        y = seq(x)
        assert seq.fusion_plan()[0] == {
            "forward": ["LinearSiLU"],
            "backward": ["BasicLinear", "SiLU"],
        }
        xr = x.detach().requires_grad_()
        ref = F.silu(xr @ lin.weight.T)
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        for a, b in zip(
            torch.autograd.grad(y, [x, lin.weight], dy),
            torch.autograd.grad(ref, [xr, lin.weight], dy),
        ):
            torch.testing.assert_close(a, b)

    def test_forward_fusion_keeps_the_linears_main_grad(self):
        """The unfused backward after a Python forward fusion routes the weight gradient into
        main_grad, as the unfused forward would have."""
        ops.register_forward_fusion(_pairwise(LinearSiLU, ops.BasicLinear, ops.SiLU))
        lin = ops.BasicLinear(4, 6, device="cpu", dtype=D, accumulate_into_main_grad=True)
        start = torch.randn(6, 4, dtype=D)
        lin.weight.main_grad = start.clone()
        x = _x(3, 4)
        seq = ops.Sequential(lin, ops.SiLU())
        dy = torch.randn(3, 6, dtype=D)
        seq(x).backward(dy)
        assert seq.fusion_plan()[0]["forward"] == ["LinearSiLU"]
        w = lin.weight.detach().clone().requires_grad_()
        F.silu(x.detach() @ w.T).backward(dy)
        torch.testing.assert_close(lin.weight.main_grad, start + w.grad)
        assert lin.weight.grad is None

    def test_forward_fusion_then_builtin_backward_fusion_keeps_main_grad(self):
        """A Python forward fusion over the linear, then a built-in backward fusion of it
        (BackwardLinearScale): the weight gradient still goes into main_grad, accumulated over
        steps, and autograd gets none."""
        ops.register_forward_fusion(_pairwise(LinearThenScale, ops.BasicLinear, ops.ConstantScale))
        lin = ops.BasicLinear(4, 6, device="cpu", dtype=D, accumulate_into_main_grad=True)
        start = torch.randn(6, 4, dtype=D)
        lin.weight.main_grad = start.clone()
        seq = ops.Sequential(lin, ops.ConstantScale(-0.5))
        want = start.clone()
        for _ in range(2):
            x = _x(3, 4)
            dy = torch.randn(3, 6, dtype=D)
            y = seq(x)
            assert seq.fusion_plan()[0] == {
                "forward": ["LinearThenScale"],
                "backward": ["BackwardLinearScale"],
            }
            y.backward(dy)
            w = lin.weight.detach().clone().requires_grad_()
            xr = x.detach().clone().requires_grad_()
            (-0.5 * (xr @ w.T)).backward(dy)
            want += w.grad
            torch.testing.assert_close(x.grad, xr.grad)
            torch.testing.assert_close(lin.weight.main_grad, want)
            assert lin.weight.grad is None

    def test_backward_only_reads_what_basic_linear_saved(self):
        ops.register_backward_fusion(
            _pairwise(ScaleThenLinearBackward, ops.ConstantScale, ops.BasicLinear)
        )
        lin = ops.BasicLinear(4, 3, device="cpu", dtype=D)
        fuser = ops.OperationFuser([ops.ConstantScale(-2.0), lin])
        x = _x(2, 4)
        y = fuser(x)
        assert fuser.fusion_plan()[0] == {
            "forward": ["ConstantScale", "BasicLinear"],
            "backward": ["ScaleThenLinearBackward"],
        }
        xr = x.detach().requires_grad_()
        ref = (-2.0 * xr) @ lin.weight.T
        dy = torch.randn_like(y)
        for a, b in zip(
            torch.autograd.grad(y, [x, lin.weight], dy),
            torch.autograd.grad(ref, [xr, lin.weight], dy),
        ):
            torch.testing.assert_close(a, b)

    def test_joint_fused_op_is_the_same_object_in_both_plans(self):
        ops.register_forward_backward_fusion(
            _pairwise(JointScales, ops.ConstantScale, ops.ConstantScale)
        )
        fuser = ops.OperationFuser([ops.ConstantScale(2.0), ops.ConstantScale(3.0)])
        x = _x(4)
        y = fuser(x)
        f, b = fuser.forward_ops()[0][0], fuser.backward_ops()[0][0]
        assert isinstance(f, JointScales) and f is b
        torch.testing.assert_close(y, 6 * x)
        (g,) = torch.autograd.grad(y, [x], torch.ones(4, dtype=D))
        torch.testing.assert_close(g, torch.full((4,), 6.0, dtype=D))

    def test_python_fused_op_wires_producer_to_consumer(self):
        class ResidualScale(ops.FusedOperation):
            def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
                assert basic_op_extra_inputs[2] == [None]  # wired inside: the fuser passes none
                return 3.0 * input_, [[None], [], []]

            def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
                return 3.0 * grad_output, [[], [], []], [[], [], [None]]

        def fuse(ops_list, *, recipe):
            if len(ops_list) == 3 and isinstance(ops_list[0], ops.MakeExtraOutput):
                return [ResidualScale(ops_list)]
            return ops_list

        ops.register_forward_backward_fusion(fuse)
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
        add = ops.AddExtraInput().set_extra_input_channel(0, "r")
        fuser = ops.OperationFuser([make, ops.ConstantScale(2.0), add])
        x = _x(4)
        y = fuser(x)
        torch.testing.assert_close(y, 3 * x)
        (g,) = torch.autograd.grad(y, [x], torch.ones(4, dtype=D))
        torch.testing.assert_close(g, torch.full((4,), 3.0, dtype=D))

    def test_unregister(self):
        ops.register_forward_fusion(fuse_axpy)
        assert ops.unregister_fusion(fuse_axpy)
        assert not ops.unregister_fusion(fuse_axpy)
        fuser = ops.OperationFuser([ops.ConstantScale(2.0), ops.AddExtraInput()])
        fuser(_x(2), _x(2))
        assert fuser.fusion_plan()[0]["forward"] == ["ConstantScale", "AddExtraInput"]


class TestUserCodeErrors:
    def test_wrong_returns_give_clear_errors(self):
        class NoTensor(ops.BasicOperation):
            def op_forward(self, ctx, input_, **unused):
                return 3

        class BadGrads(ops.BasicOperation):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(()))

            def op_forward(self, ctx, input_, **unused):
                return input_ * self.w

            def op_backward(self, ctx, grad_output):
                return grad_output, []  # one parameter, no gradient listed

        class GeneratorOutputs(ops.BasicOperation):
            num_extra_outputs = 1

            def fuser_forward(self, basic_op_ctxs, input_, **unused):
                return input_, (t for t in [[input_]])

        class WrongCount(ops.BasicOperation):
            num_extra_outputs = 1

            def fuser_forward(self, basic_op_ctxs, input_, **unused):
                return input_, [[input_, input_]]

        x = _x(3)
        with pytest.raises(TypeError, match="NoTensor.op_forward.*expected a tensor"):
            NoTensor()(x)
        with pytest.raises(ValueError, match="BadGrads.op_backward parameter grads: expected 1"):
            BadGrads()(x).sum().backward()
        with pytest.raises(
            TypeError, match="GeneratorOutputs.fuser_forward extra outputs: expected a list"
        ):
            GeneratorOutputs()(x)
        with pytest.raises(
            ValueError, match=r"WrongCount.fuser_forward extra outputs\[0\]: expected 1"
        ):
            WrongCount()(x)

    def test_fusion_returning_other_ops_is_rejected(self):
        def bad(ops_list, *, recipe):
            return [ops.Identity()]

        ops.register_forward_fusion(bad)
        with pytest.raises(RuntimeError, match="do not expand back to the basic ops"):
            ops.OperationFuser([ops.Identity()])(_x(2))

    def test_fusion_returning_non_ops_is_rejected(self):
        def bad(ops_list, *, recipe):
            return [object()]

        ops.register_forward_fusion(bad)
        with pytest.raises(TypeError, match="expected fusible operations"):
            ops.OperationFuser([ops.Identity()])(_x(2))


class TestReviewRegressions:
    def test_one_direction_fused_op_keeps_channel_routing(self):
        class ForwardOnly(ops.FusedOperation):
            def fuser_forward(self, basic_op_ctxs, input_, **unused):
                return 3.0 * input_, [[None], [], []]

        class BackwardOnly(ops.FusedOperation):
            def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
                return 3.0 * grad_output, [[], [], []], [[], [], [None]]

        for cls in (ForwardOnly, BackwardOnly):

            def fuse(ops_list, *, recipe, cls=cls):
                if len(ops_list) == 3 and isinstance(ops_list[0], ops.MakeExtraOutput):
                    return [cls(ops_list)]
                return ops_list

            snap = ops.snapshot_fusions()
            ops.register_forward_backward_fusion(fuse)
            make = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
            add = ops.AddExtraInput().set_extra_input_channel(0, "r")
            fuser = ops.OperationFuser([make, ops.ConstantScale(2.0), add])
            x = _x(4)
            y = fuser(x)
            torch.testing.assert_close(y, 3 * x)
            (g,) = torch.autograd.grad(y, [x], torch.ones(4, dtype=D))
            torch.testing.assert_close(g, torch.full((4,), 3.0, dtype=D))
            ops.restore_fusions(snap)

    def test_reset_parameters_with_custom_ops_does_not_recurse(self):
        seq = ops.Sequential(LearnableScale(), ops.Identity(), ops.Bias(4, device="cpu", dtype=D))
        seq.reset_parameters()
        assert torch.equal(seq[2].bias.detach(), torch.zeros(4, dtype=D))

    def test_non_tensor_extra_input_names_the_op(self):
        with pytest.raises(
            ValueError, match="AddExtraInput: expected extra input 0 to be a tensor"
        ):
            ops.AddExtraInput()(_x(3), None)

    def test_in_place_add_from_a_channel_does_not_corrupt_saved_tensors(self):
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
        ln = ops.LayerNorm(4, device="cpu", dtype=D)
        add = ops.AddExtraInput(in_place=True).set_extra_input_channel(0, "res")
        fuser = ops.OperationFuser([make, ln, add])
        x = _x(3, 4)
        x0 = x.detach().clone()
        y = fuser(x)
        assert torch.equal(x.detach(), x0)
        xr = x0.clone().requires_grad_()
        ref = F.layer_norm(xr, (4,), ln.weight, ln.bias, 1e-5) + xr
        torch.testing.assert_close(y, ref)
        dy = torch.randn_like(y)
        torch.testing.assert_close(
            torch.autograd.grad(y, [x], dy)[0], torch.autograd.grad(ref, [xr], dy)[0]
        )


class KeepsContext(ops.BasicOperation):
    """y = 2x; keeps its context in a list the test reads after everything else is gone."""

    kept = []

    def op_forward(self, ctx, input_, **unused):
        ctx.note = "forward ran"
        ctx.save_for_backward(input_)
        KeepsContext.kept.append(ctx)
        return 2 * input_

    def op_backward(self, ctx, grad_output):
        ctx.note = "backward ran"
        return 2 * grad_output, []


class TestLifetimes:
    def test_context_kept_by_python_outlives_the_call(self):
        import gc

        KeepsContext.kept.clear()
        seq = ops.Sequential(KeepsContext(), ops.ConstantScale(3.0))
        x = _x(4)
        seq(x).sum().backward()
        del seq, x
        gc.collect()
        (ctx,) = KeepsContext.kept
        # The C++ context is shared with Python, not borrowed: still valid, attributes intact.
        assert ctx.note == "backward ran" and ctx.requires_grad and ctx.input_requires_grad
        KeepsContext.kept.clear()

    def test_fused_op_from_a_fusion_is_freed_with_its_plan(self):
        import gc
        import weakref

        made = []

        def fuse_and_record(ops_list, *, recipe):
            out = fuse_axpy(ops_list, recipe=recipe)
            made.extend(weakref.ref(op) for op in out if isinstance(op, Axpy))
            return out

        ops.register_forward_fusion(fuse_and_record)
        fuser = ops.OperationFuser([ops.ConstantScale(0.25), ops.AddExtraInput()])
        x, r = _x(5), _x(5)
        torch.testing.assert_close(fuser(x, r), 0.25 * x + r)
        assert made and made[-1]() is not None  # alive while the plan uses it
        assert isinstance(fuser.forward_ops()[0][0], Axpy)
        del fuser
        gc.collect()
        # No cycle through C++ (which Python's GC cannot see): the fused op is gone with the plan.
        assert all(ref() is None for ref in made)


class TestCopiesOfPythonOps:
    def test_deepcopy_of_a_python_op_and_a_python_fusion(self):
        import copy

        ops.register_forward_fusion(fuse_axpy)
        model = ops.Sequential(LearnableScale(), ops.ConstantScale(0.25), ops.AddExtraInput())
        x, r = _x(5), _x(5)
        y = model(x, r)
        clone = copy.deepcopy(model)
        assert clone[0].weight is not model[0].weight
        torch.testing.assert_close(clone(x, r), y, rtol=0, atol=0)
        assert clone.fusion_plan() == model.fusion_plan()
        assert clone.fusion_plan()[0]["forward"] == ["LearnableScale", "Axpy"]
        with torch.no_grad():
            clone[0].weight.fill_(2.0)
        torch.testing.assert_close(clone(x, r), 0.25 * (2.0 * x) + r)
        torch.testing.assert_close(model(x, r), y, rtol=0, atol=0)


class RecomputedTanh(ops.BasicOperation):
    """y = tanh(x), its backward recomputing the forward under enable_grad (activation recompute),
    as a te.ops op may: autograd works inside a Python op's backward."""

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return torch.tanh(input_)

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(torch.tanh(x), [x], grad_output)
        return dx, []


def test_python_op_backward_can_use_autograd():
    # The fuser runs its own ops below autograd; a Python op's backward still sees autograd.
    seq = ops.Sequential(
        ops.Linear(4, 4, dtype=D, device="cpu"), RecomputedTanh(), ops.ConstantScale(2.0)
    )
    x = _x(3, 4)
    dy = torch.randn(3, 4, dtype=D)
    y = seq(x)
    fc = seq[0]
    xr = x.detach().requires_grad_()
    ref = 2.0 * torch.tanh(F.linear(xr, fc.weight, fc.bias))
    torch.testing.assert_close(y, ref)
    gx, gw = torch.autograd.grad(y, [x, fc.weight], dy)
    rx, rw = torch.autograd.grad(ref, [xr, fc.weight], dy)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


class ScaleShift(ops.BasicOperation):
    """y = x * w + b: two parameters, whose gradients op_backward returns in registration order."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, dtype=D))
        self.bias = torch.nn.Parameter(torch.randn(n, dtype=D))

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return input_ * self.weight.detach() + self.bias.detach()

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * self.weight.detach(), [(grad_output * x).sum(0), grad_output.sum(0)]


class TorchScaleShift(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.weight = torch.nn.Parameter(op.weight.detach().clone())
        self.bias = torch.nn.Parameter(op.bias.detach().clone())

    def forward(self, x):
        return x * self.weight + self.bias


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


_REPARAMETRIZE = {
    "prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.5),
    "parametrize": lambda m: torch.nn.utils.parametrize.register_parametrization(
        m, "weight", _Doubled()
    ),
    "weight_norm": lambda m: torch.nn.utils.parametrizations.weight_norm(m, "weight", dim=None),
    # Both remove "weight" before registering their own (weight_orig; weight_g and weight_v).
    "spectral_norm": lambda m: torch.nn.utils.spectral_norm(m, "weight"),
    "old_weight_norm": lambda m: torch.nn.utils.weight_norm(m, "weight", dim=None),
}


class TestReparametrizedPythonOps:
    @pytest.mark.parametrize("kind", list(_REPARAMETRIZE))
    @pytest.mark.parametrize("in_sequential", [False, True])
    @pytest.mark.parametrize("called_before", [False, True])
    def test_training_matches_torch(self, kind, in_sequential, called_before):
        """prune re-registers the weight after the bias (weight_orig): the gradients op_backward
        returns in registration order still reach the parameters they belong to."""
        torch.manual_seed(0)
        op = ScaleShift(8)
        twin = TorchScaleShift(op)
        model = ops.Sequential(ops.Identity(), op) if in_sequential else op
        if called_before:
            model(_x(3, 8))
        for m in (op, twin):
            torch.manual_seed(1)  # spectral_norm's random start vector: the same for both
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm
                _REPARAMETRIZE[kind](m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
        for _ in range(3):
            x = _x(4, 8)
            for o, f in ((opt, model), (opt_twin, twin)):
                o.zero_grad()
                f(x).pow(2).sum().backward()
                o.step()
        got, want = dict(op.named_parameters()), dict(twin.named_parameters())
        assert got.keys() == want.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name])

    def test_a_pruned_op_reloads_with_assign(self):
        """load_state_dict(assign=True) re-registers weight_orig while "weight" is computed: it
        stays the weight's storage, not a third parameter."""
        torch.manual_seed(2)
        op, twin = ScaleShift(8), None
        twin = TorchScaleShift(op)
        for m in (op, twin):
            prune.l1_unstructured(m, "weight", amount=0.5)
        op.load_state_dict({k: v.clone() for k, v in op.state_dict().items()}, assign=True)
        x = _x(4, 8)
        op(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
        for name, p in twin.named_parameters():
            torch.testing.assert_close(dict(op.named_parameters())[name].grad, p.grad)

    def test_a_slot_registered_empty_keeps_its_place(self):
        """register_parameter("weight", None) first, the bias next, the weight filled last:
        op_backward's [dW, db] still reach weight and bias."""

        class LateWeight(ScaleShift):
            def __init__(self, n):
                ops.BasicOperation.__init__(self)
                self.register_parameter("weight", None)
                self.bias = torch.nn.Parameter(torch.randn(n, dtype=D))
                self.weight = torch.nn.Parameter(torch.randn(n, dtype=D))

        torch.manual_seed(3)
        op = LateWeight(8)
        twin = TorchScaleShift(op)
        x = _x(4, 8)
        op(x).pow(2).sum().backward()
        twin(x).pow(2).sum().backward()
        torch.testing.assert_close(op.weight.grad, twin.weight.grad)
        torch.testing.assert_close(op.bias.grad, twin.bias.grad)

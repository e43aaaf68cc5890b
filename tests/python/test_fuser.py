"""OperationFuser and Sequential: plans, first-backward index, no-grad path, call convention,
errors, parameters and state dicts, dtype handling."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from fusible import ops


def _mlp(device="cpu", dtype=torch.float64):
    return [
        ops.LayerNorm(8, device=device, dtype=dtype),
        ops.Linear(8, 16, device=device, dtype=dtype),
        ops.GELU(),
        ops.Linear(16, 8, device=device, dtype=dtype),
    ]


def _ref_mlp(mods, x):
    ln, fc1, _, fc2 = mods
    h = F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5)
    return F.linear(
        F.gelu(F.linear(h, fc1.weight, fc1.bias), approximate="tanh"), fc2.weight, fc2.bias
    )


class TestOperationFuser:
    def test_matches_reference_and_plan_expands_to_basic_ops(self):
        mods = _mlp()
        fuser = ops.OperationFuser(mods)
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        y = fuser(x)
        torch.testing.assert_close(y, _ref_mlp(mods, x))
        plan = fuser.forward_ops()
        # GELU goes into the first GEMM's epilogue; the second linear has no activation after it.
        assert [idx for _, idx in plan] == [[0], [1, 2, 3], [4, 5]]
        assert plan[0][0] is mods[0]
        fused = plan[1][0]
        assert isinstance(fused, ops.fused.ForwardLinearBiasActivation)
        assert list(fused.basic_ops) == [*mods[1].basic_ops, mods[2]]
        assert fuser.fusion_plan()[0]["forward"] == [
            "LayerNorm",
            "ForwardLinearBiasActivation",
            "ForwardLinearBiasActivation",
        ]
        # Backward: Bias + GELU go into the second linear's dgrad epilogue.
        backward = fuser.backward_ops()
        assert [idx for _, idx in backward] == [[0], [1], [2, 3, 4], [5]]
        assert backward[1][0] is mods[1].basic_ops[0]
        assert fuser.fusion_plan()[0]["backward"] == [
            "LayerNorm",
            "BasicLinear",
            "BackwardLinearActivationBias",
            "Bias",
        ]

    def test_one_autograd_node_and_gradients(self):
        mods = _mlp()
        fuser = ops.OperationFuser(mods)
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        y = fuser(x)
        assert y.grad_fn is not None and y.grad_fn.next_functions[0][0] is not None
        assert "FuserAutograd" in type(y.grad_fn).__name__ or "Fuser" in y.grad_fn.name()
        params = [p for m in mods for p in m.parameters()]
        grads = torch.autograd.grad(y.pow(2).sum(), [x, *params])
        xr = x.detach().requires_grad_()
        ref_grads = torch.autograd.grad(_ref_mlp(mods, xr).pow(2).sum(), [xr, *params])
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)

    def test_no_grad_builds_no_node(self):
        fuser = ops.OperationFuser(_mlp())
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            y = fuser(x)
        assert y.grad_fn is None and not y.requires_grad

    def test_input_without_grad_and_frozen_params(self):
        mods = _mlp()
        for p in mods[0].parameters():
            p.requires_grad_(False)
        fuser = ops.OperationFuser(mods)
        x = torch.randn(5, 8, dtype=torch.float64)
        y = fuser(x)
        y.sum().backward()
        assert mods[0].weight.grad is None
        assert mods[1].weight.grad is not None and mods[3].bias.grad is not None

    def test_an_op_at_two_positions_before_and_after_the_first_backward(self):
        """A frozen Bias and a GELU tied at two positions, the input without grad: only their
        second occurrence runs a backward, so no backward fusion may take the first one's."""
        D = torch.float64
        torch.manual_seed(0)
        b, g = ops.Bias(4, dtype=D, device="cpu"), ops.GELU()
        fc = ops.BasicLinear(4, 4, dtype=D, device="cpu")
        with torch.no_grad():
            b.bias.normal_()
            fc.weight.normal_()
        b.bias.requires_grad_(False)
        fuser = ops.OperationFuser([b, g, fc, b, g])
        x = torch.randn(3, 4, dtype=D)
        y = fuser(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        w = fc.weight.detach().requires_grad_()
        ref = F.gelu(F.gelu(x + b.bias, approximate="tanh") @ w.T + b.bias, approximate="tanh")
        ref.backward(dy)
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(fc.weight.grad, w.grad)

    def test_everything_frozen_builds_no_node(self):
        mods = _mlp()
        for m in mods:
            for p in m.parameters():
                p.requires_grad_(False)
        y = ops.OperationFuser(mods)(torch.randn(5, 8, dtype=torch.float64))
        assert y.grad_fn is None

    def test_extra_inputs_and_outputs(self):
        fuser = ops.OperationFuser(
            [ops.MakeExtraOutput(), ops.ConstantScale(2.0), ops.AddExtraInput()]
        )
        assert fuser.num_extra_inputs == 1
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        r = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        y, extra = fuser(x, r)
        torch.testing.assert_close(y, 2 * x + r, rtol=0, atol=0)
        torch.testing.assert_close(extra, x, rtol=0, atol=0)
        dy, de = torch.randn_like(y), torch.randn_like(extra)
        torch.autograd.backward([y, extra], [dy, de])
        torch.testing.assert_close(x.grad, 2 * dy + de, rtol=0, atol=0)
        torch.testing.assert_close(r.grad, dy, rtol=0, atol=0)

    def test_only_extra_output_used(self):
        fuser = ops.OperationFuser([ops.MakeExtraOutput(), ops.ConstantScale(3.0)])
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        _, extra = fuser(x)
        extra.sum().backward()
        torch.testing.assert_close(x.grad, torch.ones_like(x), rtol=0, atol=0)

    def test_in_place_add(self):
        fuser = ops.OperationFuser([ops.ConstantScale(2.0), ops.AddExtraInput(in_place=True)])
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        r0 = torch.randn(4, dtype=torch.float64)
        r = r0.clone()
        y = fuser(x, r)
        assert y.data_ptr() == r.data_ptr()
        torch.testing.assert_close(r, 2 * x.detach() + r0, rtol=0, atol=0)
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))

    @pytest.mark.parametrize("linear", [False, True])
    def test_in_place_add_into_a_slice_without_autograd(self, linear):
        """te.ops writes x + extra into a slice of the caller's buffer: with no autograd node
        recorded (no_grad here) the slice is written too (ForwardLinearBiasAdd or the add)."""
        D = torch.float64
        torch.manual_seed(3)
        first = ops.Linear(4, 4, dtype=D, device="cpu") if linear else ops.ConstantScale(2.0)
        if linear:
            torch.nn.init.normal_(first.bias)
        fuser = ops.OperationFuser([first, ops.AddExtraInput(in_place=True)])
        x = torch.randn(3, 4, dtype=D)
        buf = torch.randn(2, 3, 4, dtype=D)
        want = first(x) + buf[1]
        with torch.no_grad():
            y = fuser(x, buf[1])
        assert y.data_ptr() == buf[1].data_ptr()
        torch.testing.assert_close(buf[1], want)

    def test_in_place_add_refuses_a_leaf_that_requires_grad(self):
        """As torch's in-place ops: a parameter (or any leaf requiring grad) is not written while
        autograd records, here nor in a reentrant checkpoint's recompute (which makes the inputs
        such leaves: it added into them a second time, x's gradient off by 0.3); under no_grad the
        write goes ahead, and a non-leaf is written as before."""
        D = torch.float64
        torch.manual_seed(5)
        lin = ops.Linear(8, 8, dtype=D, device="cpu")
        torch.nn.init.normal_(lin.bias)
        seq = ops.Sequential(lin, ops.AddExtraInput(in_place=True), ops.GELU())
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        pos = torch.nn.Parameter(torch.randn(4, 8, dtype=D))
        before = pos.detach().clone()
        with pytest.raises(RuntimeError, match="AddExtraInput: a leaf Variable that requires grad"):
            seq(x, pos)
        assert torch.equal(pos.detach(), before)
        with torch.no_grad():
            seq(x, pos)
        torch.testing.assert_close(pos.detach(), lin(x).detach() + before)

        r = torch.randn(4, 8, dtype=D, requires_grad=True)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            torch.utils.checkpoint.checkpoint(seq, x, r * 1.0, use_reentrant=True).sum().backward()
        y = seq(x, r * 1.0)  # a non-leaf: written in place, gradients as torch's
        y.sum().backward()
        xr, rr = x.detach().requires_grad_(), r.detach().requires_grad_()
        want = F.gelu(F.linear(xr, lin.weight, lin.bias) + rr, approximate="tanh").sum()
        gx, gr = torch.autograd.grad(want, (xr, rr))
        torch.testing.assert_close(x.grad, gx)
        torch.testing.assert_close(r.grad, gr)

    def test_in_place_add_refuses_an_extra_that_cannot_hold_the_sum(self):
        fuser = ops.OperationFuser([ops.AddExtraInput(in_place=True)])
        r = torch.zeros(4, dtype=torch.float64)
        with pytest.raises(RuntimeError, match=r"expected an extra input that holds the sum"):
            fuser(torch.ones(3, 4, dtype=torch.float64), r)
        assert torch.count_nonzero(r) == 0
        y = ops.OperationFuser([ops.AddExtraInput()])(torch.ones(3, 4, dtype=torch.float64), r)
        torch.testing.assert_close(y, torch.ones(3, 4, dtype=torch.float64))

    def test_wrong_extra_input_count(self):
        fuser = ops.OperationFuser([ops.AddExtraInput()])
        with pytest.raises(ValueError, match="expected 1 extra inputs, got 0"):
            fuser(torch.randn(3))
        # A Sequential names the op that wants it, and how to feed it.
        seq = ops.Sequential(ops.MakeExtraOutput(), ops.Linear(8, 8), ops.AddExtraInput())
        want = (
            r"expected 1 extra inputs, got 0; in order they feed AddExtraInput \(extra input 0\) "
            r"in the group from entry 0 \(pass them after the input, or bind an op's extra input"
        )
        with pytest.raises(ValueError, match=want):
            seq(torch.randn(2, 8))

    def test_bad_inputs_give_clear_errors_and_change_nothing(self):
        lin = ops.Linear(4, 3, device="cpu")
        before = lin.weight.detach().clone()
        with pytest.raises(
            RuntimeError,
            match=r"BasicLinear: expected input.size\(-1\) == in_features \(4\), got 5",
        ):
            lin(torch.randn(2, 5))
        with pytest.raises(TypeError, match="floating-point input"):
            lin(torch.ones(2, 4, dtype=torch.long))
        with pytest.raises(RuntimeError, match="LayerNorm: expected input's trailing dims"):
            ops.LayerNorm(4, device="cpu")(torch.randn(2, 3))
        with pytest.raises(RuntimeError, match="even last dim"):
            ops.SwiGLU()(torch.randn(2, 3))
        with pytest.raises(RuntimeError, match="ScaledSwiGLU: expected scales of shape"):
            ops.ScaledSwiGLU()(torch.randn(2, 4), torch.randn(3))
        assert torch.equal(lin.weight, before)
        lin(torch.randn(2, 4))  # still usable

    def test_unsupported_keywords(self):
        with pytest.raises(NotImplementedError, match="rng_state_tracker_function"):
            ops.Linear(4, 4, rng_state_tracker_function=lambda: None)
        with pytest.raises(NotImplementedError, match="userbuffers_options"):
            ops.BasicLinear(4, 4, userbuffers_options={})


class TestShapesAndDtypes:
    @pytest.mark.parametrize("shape", [(8,), (2, 3, 8)])
    def test_linear_any_rank(self, shape):
        lin = ops.Linear(8, 5, device="cpu", dtype=torch.float64)
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        y = lin(x)
        assert y.shape == shape[:-1] + (5,)
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias))

    def test_zero_dim_elementwise(self):
        x = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        y = ops.SiLU()(x)
        assert y.dim() == 0
        y.backward()
        xr = x.detach().requires_grad_()
        F.silu(xr).backward()
        torch.testing.assert_close(x.grad, xr.grad)

    def test_input_cast_to_parameter_dtype(self):
        lin = ops.Linear(4, 3, device="cpu", dtype=torch.float64)
        x = torch.randn(2, 4, dtype=torch.float32, requires_grad=True)
        y = lin(x)
        assert y.dtype == torch.float64
        y.sum().backward()
        assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float64

    def test_autocast_sets_compute_dtype(self):
        lin = ops.Linear(4, 3, device="cpu", dtype=torch.float32)
        x = torch.randn(2, 4, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32

    def test_autocast_and_the_ops_without_parameters(self):
        # te.ops: a training Dropout computes in the autocast dtype (as the activations),
        # L2Normalization in the input's (a float32 QK-norm stays float32).
        x = torch.randn(64, 8, requires_grad=True)
        drop = ops.Dropout(0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = drop(x)
            z = ops.L2Normalization()(x)
        assert y.dtype == torch.bfloat16 and z.dtype == torch.float32
        kept = y != 0
        torch.testing.assert_close(y[kept], (x.detach().bfloat16() * 2)[kept], rtol=0, atol=0)
        torch.testing.assert_close(z, x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt())
        (y.float().sum() + z.sum()).backward()
        assert x.grad.dtype == torch.float32
        drop.eval()  # te.ops' evaluation returns x as it is
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_eval = drop(x)
        assert y_eval.dtype == torch.float32 and torch.equal(y_eval, x.detach())


class TestParametersAndStateDict:
    def test_parameters_are_shared_nn_parameters(self):
        lin = ops.Linear(4, 3, device="cpu")
        assert all(isinstance(p, torch.nn.Parameter) for p in lin.parameters())
        assert lin.weight is lin.basic_ops[0].weight and lin.bias is lin.basic_ops[1].bias
        assert [n for n, _ in lin.named_parameters()] == ["weight", "bias"]
        x = torch.randn(2, 4)
        lin(x).sum().backward()
        assert lin.weight.grad is not None  # the C++ op's leaf is the Python Parameter

    def test_loads_torch_linear_state_dict(self):
        ref = torch.nn.Linear(4, 3)
        lin = ops.Linear(4, 3, device="cpu")
        lin.load_state_dict(ref.state_dict())
        x = torch.randn(2, 4)
        torch.testing.assert_close(lin(x), ref(x))
        ref.load_state_dict(lin.state_dict())

    def test_default_init(self):
        torch.manual_seed(0)
        lin = ops.Linear(64, 32, device="cpu")
        bound = 1 / 8
        assert lin.weight.abs().max() <= bound and lin.weight.std() > bound / 4
        assert torch.equal(lin.bias, torch.zeros(32))
        ln = ops.LayerNorm(8, device="cpu", zero_centered_gamma=True)
        assert torch.equal(ln.weight, torch.zeros(8)) and torch.equal(ln.bias, torch.zeros(8))
        assert torch.equal(ops.RMSNorm(8, device="cpu").weight, torch.ones(8))

    def test_train_eval_reach_dropout(self):
        drop = ops.Dropout(0.5)
        x = torch.randn(1000, dtype=torch.float64) + 3
        y = drop(x)
        zeros = (y == 0).double().mean().item()
        assert 0.4 < zeros < 0.6
        kept = y != 0
        torch.testing.assert_close(y[kept], 2 * x[kept])
        seq = ops.Sequential(drop)
        seq.eval()
        assert torch.equal(seq(x), x)


class TestSequential:
    def test_groups_and_plan(self):
        seq = ops.Sequential(
            ops.Linear(4, 4, device="cpu"), ops.GELU(), torch.nn.Tanh(), ops.Bias(4, device="cpu")
        )
        x = torch.randn(3, 4, requires_grad=True)
        y = seq(x)
        plan = seq.fusion_plan()
        assert plan == [
            {
                "forward": ["ForwardLinearBiasActivation"],
                "backward": ["BasicLinear", "BackwardActivationBias"],
            },
            {"module": "Tanh"},
            {"forward": ["Bias"], "backward": ["Bias"]},
        ]
        ref = (
            torch.tanh(F.gelu(F.linear(x, seq[0].weight, seq[0].bias), approximate="tanh"))
            + seq[3].bias
        )
        torch.testing.assert_close(y, ref)
        assert len(seq.fusers()) == 3

    def test_list_api(self):
        a, b, c = ops.Identity(), ops.GELU(), ops.ReLU()
        seq = ops.Sequential(a, b)
        seq.append(c)
        assert len(seq) == 3 and seq[-1] is c and list(seq) == [a, b, c]
        assert list(seq[1:]) == [b, c]
        seq.insert(0, ops.SiLU())
        assert isinstance(seq[0], ops.SiLU)
        popped = seq.pop(0)
        assert isinstance(popped, ops.SiLU) and list(seq) == [a, b, c]
        seq.append(ops.SiLU())
        popped = seq.pop(slice(3, None))  # te.ops' pop takes a slice too
        assert isinstance(popped, ops.Sequential) and isinstance(popped[0], ops.SiLU)
        assert list(seq) == [a, b, c]
        seq[1] = ops.SReLU()
        del seq[0]
        assert len(seq) == 2 and isinstance(seq[0], ops.SReLU)
        seq2 = seq + ops.Sequential(ops.Identity())
        assert len(seq2) == 3
        seq += [ops.Identity()]
        assert len(seq) == 3
        x = torch.randn(5)
        torch.testing.assert_close(seq(x), F.relu(F.relu(x) ** 2))

    def test_state_dict_keys(self):
        seq = ops.Sequential(ops.LayerNorm(4, device="cpu"), ops.Linear(4, 2, device="cpu"))
        assert list(seq.state_dict().keys()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


class TestPlanCache:
    def test_in_place_dtype_change_re_plans(self):
        lin = ops.Linear(4, 3, device="cpu", dtype=torch.float32)
        fuser = ops.OperationFuser([lin])
        fuser(torch.randn(2, 4))
        assert fuser.fusion_plan()[0]["forward"] == ["ForwardLinearBiasActivation"]
        lin.basic_ops[1].to(torch.float64)  # the bias alone: the fusion's precondition fails
        y = fuser(torch.randn(2, 4))
        assert fuser.fusion_plan()[0]["forward"] == ["BasicLinear", "Bias"]
        assert y.dtype == torch.float64

"""What every torch.nn.Module promises: parameters read at each call, copies, meta and fake
inputs, inference-mode materialization, double backward, hooks, compile, repr. One test per
promise and per defect of the module-semantics issue."""

import copy
import io
import pickle
import warnings

import pytest
import torch
from conftest import DEVICES, randomized
from fusible import ops

D = torch.float64


def _mlp(channels=False):
    """LayerNorm -> Linear -> GELU -> Linear, plus a residual (through a channel when asked)."""
    torch.manual_seed(0)
    make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
    if channels:
        make.set_extra_output_channel(0, "residual", output_to_caller=False)
        add.set_extra_input_channel(0, "residual")
    body = [
        ops.LayerNorm(8, dtype=D, device="cpu"),
        ops.Linear(8, 16, dtype=D, device="cpu"),
        ops.GELU(),
        ops.Linear(16, 8, dtype=D, device="cpu"),
    ]
    return ops.Sequential(make, *body, add) if channels else ops.Sequential(*body)


def _ref_mlp(model, x):
    """The same computation in plain torch, from the model's current parameters."""
    ln, fc1, fc2 = model[1], model[2], model[4]
    h = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, ln.eps)
    h = torch.nn.functional.gelu(
        torch.nn.functional.linear(h, fc1.weight, fc1.bias), approximate="tanh"
    )
    return torch.nn.functional.linear(h, fc2.weight, fc2.bias) + x


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class TestParametersReadPerCall:
    def test_functional_call_zeros(self):
        lin = ops.Linear(8, 4, dtype=D, device="cpu")
        x = torch.randn(3, 8, dtype=D, device="cpu")
        zeros = {
            "weight": torch.zeros(4, 8, dtype=D, requires_grad=True),
            "bias": torch.zeros(4, dtype=D, requires_grad=True),
        }
        y = torch.func.functional_call(lin, zeros, (x,))
        assert torch.equal(y, torch.zeros(3, 4, dtype=D, device="cpu"))
        y.backward(torch.ones(3, 4, dtype=D, device="cpu"))
        # Gradients land on the supplied tensors, not on the module's own.
        torch.testing.assert_close(zeros["weight"].grad, x.sum(0).expand(4, 8), rtol=0, atol=1e-12)
        torch.testing.assert_close(zeros["bias"].grad, torch.full((4,), 3.0, dtype=D, device="cpu"))
        assert lin.weight.grad is None and lin.bias.grad is None
        # And the module computes with its own again afterwards.
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)

    def test_functional_call_through_sequential(self):
        model = _mlp(channels=True)
        x = torch.randn(5, 8, dtype=D, device="cpu")
        params = {k: torch.randn_like(v) for k, v in model.named_parameters()}
        y = torch.func.functional_call(model, params, (x,))
        ref_model = copy.deepcopy(model)
        ref_model.load_state_dict(params)
        torch.testing.assert_close(y, _ref_mlp(ref_model, x))

    def test_weight_norm_takes_effect(self):
        lin = ops.Linear(8, 4, dtype=D, device="cpu")
        torch.nn.utils.parametrizations.weight_norm(lin)
        with torch.no_grad():
            lin.parametrizations.weight.original0.mul_(3.0)  # the norm: weight scales by 3
        x = torch.randn(2, 8, dtype=D, device="cpu")
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)
        lin(x).sum().backward()
        assert lin.parametrizations.weight.original0.grad is not None
        assert lin.parametrizations.weight.original1.grad is not None

    def test_deepcopy_under_weight_norm(self):
        """copy.deepcopy of a parametrized op (torch.nn.Linear's behaviour): an independent copy
        that computes the same and trains on its own; pickling it is refused as torch refuses it."""
        torch.manual_seed(0)
        model = ops.Sequential(ops.Linear(8, 4, dtype=D, device="cpu"), ops.GELU())
        torch.nn.utils.parametrizations.weight_norm(model[0])
        with torch.no_grad():
            model[0].bias.uniform_(-1, 1)
            model[0].parametrizations.weight.original0.mul_(2.0)
        clone = copy.deepcopy(model)
        x = torch.randn(3, 8, dtype=D, device="cpu")
        torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
        original = clone[0].parametrizations.weight.original1
        assert original is not model[0].parametrizations.weight.original1
        clone(x).sum().backward()
        assert original.grad is not None and model[0].parametrizations.weight.original1.grad is None
        with torch.no_grad():
            original.add_(1.0)
        lin = clone[0]
        ref = torch.nn.functional.gelu(x @ lin.weight.T + lin.bias, approximate="tanh")
        torch.testing.assert_close(clone(x), ref)
        assert not torch.allclose(clone(x), model(x))
        with pytest.raises(RuntimeError, match="state_dict"):
            pickle.dumps(model[0])

    def test_load_state_dict_assign(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(new, assign=True)
        assert model[1].weight.data_ptr() == new["1.weight"].data_ptr()
        ln, fc1, fc2 = model[0], model[1], model[3]
        h = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, ln.eps)
        h = torch.nn.functional.gelu(
            torch.nn.functional.linear(h, fc1.weight, fc1.bias), approximate="tanh"
        )
        torch.testing.assert_close(model(x), torch.nn.functional.linear(h, fc2.weight, fc2.bias))

    def test_parameter_replaced_after_first_forward(self):
        # TransformerEngine PR #3327's test_param_replaced_after_first_forward.
        model = ops.Sequential(ops.BasicLinear(8, 4, dtype=D, device="cpu"))
        x = torch.randn(3, 8, dtype=D, device="cpu")
        model(x).sum().backward()
        new = torch.nn.Parameter(torch.randn(4, 8, dtype=D, device="cpu"))
        model[0].register_parameter("weight", new)
        y = model(x)
        torch.testing.assert_close(y, x @ new.T)
        y.sum().backward()
        torch.testing.assert_close(new.grad, x.sum(0).expand(4, 8))

    def test_plain_assignment(self):
        lin = ops.Linear(8, 4, dtype=D, device="cpu")
        x = torch.randn(3, 8, dtype=D, device="cpu")
        lin(x)
        lin.weight = torch.nn.Parameter(torch.zeros(4, 8, dtype=D, device="cpu"))
        torch.testing.assert_close(lin(x), lin.bias.expand(3, 4))
        assert lin.basic_ops[0].weight is lin.weight


class TestCopies:
    @pytest.mark.parametrize(
        "make",
        [
            lambda: ops.Linear(8, 4, dtype=D, device="cpu"),
            lambda: ops.LayerNorm(8, dtype=D, device="cpu", zero_centered_gamma=True),
            lambda: ops.GELU(),
            lambda: _mlp(),
            lambda: _mlp(channels=True),
        ],
        ids=["Linear", "LayerNorm", "GELU", "Sequential", "Sequential-channels"],
    )
    @pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
    def test_round_trip(self, make, how):
        model = make()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        y0 = model(x)
        if how == "deepcopy":
            clone = copy.deepcopy(model)
        elif how == "pickle":
            clone = pickle.loads(pickle.dumps(model))
        else:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            clone = torch.load(buf, weights_only=False)
        assert type(clone) is type(model)
        assert _state_equal(model, clone)
        torch.testing.assert_close(clone(x), y0, rtol=0, atol=0)
        # Independent parameters: training the copy leaves the original alone.
        for p, q in zip(model.parameters(), clone.parameters()):
            assert p is not q and p.data_ptr() != q.data_ptr()
        with torch.no_grad():
            for q in clone.parameters():
                q.add_(1.0)
        torch.testing.assert_close(model(x), y0, rtol=0, atol=0)
        if any(True for _ in model.parameters()):
            assert not torch.equal(clone(x), y0)

    def test_copy_keeps_channels_and_is_not_locked(self):
        model = _mlp(channels=True)
        x = torch.randn(3, 8, dtype=D, device="cpu")
        model(x)
        assert model[0].channels_locked
        clone = copy.deepcopy(model)
        assert not clone[0].channels_locked  # the original's fuser does not hold the copy
        torch.testing.assert_close(clone(x), _ref_mlp(clone, x))
        assert clone[0].channels_locked
        assert clone.fusion_plan() == model.fusion_plan()

    def test_linear_aliases_survive_copy(self):
        clone = copy.deepcopy(ops.Linear(8, 4, dtype=D, device="cpu"))
        assert clone.weight is clone.basic_ops[0].weight
        assert clone.bias is clone.basic_ops[1].bias

    def test_operation_fuser_copy(self):
        lin, act = ops.Linear(8, 4, dtype=D, device="cpu"), ops.GELU()
        fuser = ops.OperationFuser([lin, act])
        x = torch.randn(2, 8, dtype=D, device="cpu")
        clone = copy.deepcopy(fuser)
        torch.testing.assert_close(clone(x), fuser(x), rtol=0, atol=0)

    def test_reset_parameters_after_assignment_resets_the_new_parameter(self):
        lin = ops.Linear(8, 4, dtype=D, device="cpu")
        new = torch.nn.Parameter(torch.full((4, 8), 100.0, dtype=D, device="cpu"))
        lin.weight = new
        lin.reset_parameters()
        assert lin.weight is new and new.abs().max() <= 8**-0.5


class TestMetaAndFake:
    def test_meta_input_elementwise(self):
        y = ops.GELU()(torch.empty(2, 8, device="meta"))
        assert y.is_meta and y.shape == (2, 8)

    def test_meta_input_through_sequential_with_channels(self):
        torch.manual_seed(0)
        make, add = ops.MakeExtraOutput(), ops.AddExtraInput()
        make.set_extra_output_channel(0, "res", output_to_caller=False)
        add.set_extra_input_channel(0, "res")
        model = ops.Sequential(
            make, ops.LayerNorm(8, device="meta"), ops.Linear(8, 8, device="meta"), add
        )
        x = torch.empty(4, 8, device="meta", requires_grad=True)
        y = model(x)
        assert y.is_meta and y.shape == (4, 8) and y.dtype == torch.float32
        assert all(p.is_meta for p in model.parameters())  # meta in: nothing materialized
        # A real input later still materializes them.
        y = model(torch.randn(4, 8))
        assert not y.is_meta and all(not p.is_meta for p in model.parameters())

    def test_default_device_context(self):
        with torch.device("meta"):
            lin = ops.Linear(8, 4)
        assert lin.weight.is_meta and lin.bias.is_meta
        torch.set_default_device("meta")
        try:
            ln = ops.LayerNorm(8)
        finally:
            torch.set_default_device(None)
        assert ln.weight.is_meta
        # No context: the current CUDA device when CUDA is available, else the CPU (te.ops).
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert ops.Linear(8, 4).weight.device.type == expected

    def test_fake_tensor_input(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        model = _mlp(channels=True)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x = mode.from_tensor(torch.randn(6, 8, dtype=D, device="cpu"))
            y = model(x)
        assert y.shape == (6, 8) and y.dtype == D
        assert type(y).__name__ == "FakeTensor"


class TestInferenceMode:
    def test_train_after_inference_mode_materialization(self):
        model = ops.Sequential(ops.LayerNorm(8, device="meta"), ops.Linear(8, 4, device="meta"))
        with torch.inference_mode():
            model(torch.randn(2, 8))
        assert all(not p.is_inference() for p in model.parameters())
        x = torch.randn(2, 8)
        model(x).sum().backward()
        assert all(p.grad is not None for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()

    def test_no_grad_materialization(self):
        lin = ops.Linear(8, 4, device="meta")
        with torch.no_grad():
            lin(torch.randn(2, 8))
        assert lin.weight.requires_grad and lin.weight.is_leaf
        lin(torch.randn(2, 8)).sum().backward()
        assert lin.weight.grad is not None


class TestDoubleBackward:
    def test_gradgradcheck_raises(self):
        ln = ops.LayerNorm(4, dtype=D, device="cpu")
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.gradgradcheck(ln, (x,))

    def test_create_graph_names_the_ops(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, requires_grad=True)
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=False)
        assert g.shape == x.shape
        with pytest.raises(RuntimeError, match="double backward.*|LayerNorm"):
            torch.autograd.grad(model(x).sum(), x, create_graph=True)

    def test_kernel_op_without_formula_raises_not_warns(self):
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = torch.ops.fusible.activation_fwd(x, "gelu")
        with pytest.raises(RuntimeError, match="fusible::activation_fwd"):
            y.sum().backward()


class TestHooks:
    def test_forward_hooks_inside_sequential_see_real_tensors(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        seen = {}
        model[1].register_forward_pre_hook(lambda m, args: seen.setdefault("in", args[0]))
        model[1].register_forward_hook(lambda m, args, out: seen.setdefault("out", out))
        y = model(x)
        ln = model[0]
        h = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, ln.eps)
        torch.testing.assert_close(seen["in"], h)
        torch.testing.assert_close(seen["out"], h @ model[1].weight.T + model[1].bias)
        torch.testing.assert_close(y, model[3](model[2](seen["out"])))
        names = [g.get("module") or g["forward"] for g in model.fusion_plan()]
        assert len(names) == 3  # the hooked op runs as its own group

    def test_forward_hook_can_replace_output(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        ref = model(x)
        handle = model[2].register_forward_hook(lambda m, args, out: out * 2)
        y = model(x)
        handle.remove()
        fc2 = model[3]
        assert not torch.allclose(y, ref)
        torch.testing.assert_close(model(x), ref)  # removing the hook restores fusion and values
        assert y.shape == ref.shape and fc2 is model[3]

    def test_global_forward_hooks_run_for_each_op_as_in_torch_sequential(self):
        """register_module_forward_(pre_)hook: torch.nn.Sequential's children run them, so every
        op of ours does too, with its real input and output; removing them restores fusion."""
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        model(x)
        fused_groups = len(model.fusion_plan())
        seen, order = {}, []
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def after(m, args, out):
            order.append(("post", m))
            seen[id(m)] = out

        pre = register_module_forward_pre_hook(lambda m, args: order.append(("pre", m)))
        post = register_module_forward_hook(after)
        try:
            y = model(x)
            groups = len(model.fusion_plan())
            order_eager = list(order)
            # Compiled, the Sequential is one call: the global hooks run for it alone.
            order.clear()
            y_compiled = torch.compile(model, backend="eager")(x)
            compiled_order = [m for kind, m in order if kind == "pre"]
        finally:
            pre.remove()
            post.remove()
        assert [m for kind, m in order_eager if kind == "pre"] == [model, *model]
        assert [m for kind, m in order_eager if kind == "post"] == [*model, model]
        assert model in compiled_order and not any(m in compiled_order for m in model)
        torch.testing.assert_close(y_compiled, y)
        ln, fc1 = model[0], model[1]
        h = torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, ln.eps)
        torch.testing.assert_close(seen[id(ln)], h)
        torch.testing.assert_close(seen[id(fc1)], h @ fc1.weight.T + fc1.bias)
        fc2 = model[3]
        ref = torch.nn.functional.gelu(seen[id(fc1)], approximate="tanh") @ fc2.weight.T + fc2.bias
        torch.testing.assert_close(y, ref)
        assert groups == len(model) and fused_groups < groups
        model(x)
        assert len(model.fusion_plan()) == fused_groups  # fused again once the hooks are gone

    def test_backward_hooks_on_an_op_inside_sequential_run(self):
        """A full backward (pre-)hook on an op runs with the op's real gradients, as in
        torch.nn.Sequential (the op runs as a group of its own while hooked)."""
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu", requires_grad=True)
        seen = {}

        def pre(m, grad_out):
            seen["pre"] = grad_out[0].clone()

        def post(m, grad_in, grad_out):
            seen["in"], seen["out"] = grad_in[0].clone(), grad_out[0].clone()

        handles = [
            model[2].register_full_backward_pre_hook(pre),
            model[2].register_full_backward_hook(post),
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # runs, so nothing to warn about
            y = model(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        ln, fc1, _, fc2 = model
        h = torch.nn.functional.layer_norm(x.detach(), (8,), ln.weight, ln.bias, ln.eps)
        pre_act = (h @ fc1.weight.T + fc1.bias).detach().requires_grad_()
        out = torch.nn.functional.gelu(pre_act, approximate="tanh")
        (out @ fc2.weight.T + fc2.bias).backward(dy)
        gelu_out_grad = dy @ fc2.weight
        torch.testing.assert_close(seen["pre"], gelu_out_grad)
        torch.testing.assert_close(seen["out"], gelu_out_grad)
        torch.testing.assert_close(seen["in"], pre_act.grad)
        for hd in handles:
            hd.remove()
        model(x)
        assert len(model.fusion_plan()) < len(model)  # fused again once the hooks are gone

    def test_global_backward_hooks_run_for_each_op_as_in_torch_sequential(self):
        from torch.nn.modules.module import (
            register_module_full_backward_hook,
            register_module_full_backward_pre_hook,
        )

        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu", requires_grad=True)
        want = model(x)
        order = []
        handles = [
            register_module_full_backward_pre_hook(lambda m, go: order.append(("pre", m))),
            register_module_full_backward_hook(lambda m, gi, go: order.append(("post", m))),
        ]
        try:
            y = model(x)
            y.sum().backward()
        finally:
            for hd in handles:
                hd.remove()
        torch.testing.assert_close(y, want)
        assert [m for kind, m in order if kind == "post"] == [*reversed(list(model)), model]
        assert [m for kind, m in order if kind == "pre"] == [model, *reversed(list(model))]


class TestSequentialChildren:
    def test_slicing_keeps_the_children_names(self):
        model = ops.Sequential(*[ops.Linear(4, 4, dtype=D, device="cpu") for _ in range(3)])
        tail = model[1:]
        assert list(tail.state_dict())[:2] == ["1.weight", "1.bias"]
        randomized(model)
        tail.load_state_dict(model.state_dict(), strict=False)  # its own layers' entries
        assert torch.equal(tail[0].weight, model[1].weight)
        assert torch.equal(model[1:2][0].weight, model[1].weight)
        x = torch.randn(2, 4, dtype=D)
        torch.testing.assert_close(tail(x), model[2](model[1](x)))

    def test_append_after_slicing_takes_a_free_name(self):
        model = randomized(
            ops.Sequential(*[ops.Linear(4, 4, dtype=D, device="cpu") for _ in range(3)])
        )
        tail = model[1:]
        tail.append(ops.ReLU())
        assert list(tail._modules) == ["1", "2", "3"]
        assert tail[1] is model[2] and isinstance(tail[2], ops.ReLU)
        x = torch.randn(2, 4, dtype=D)
        torch.testing.assert_close(tail(x), torch.relu(model[2](model[1](x))))

    def test_a_forward_set_on_an_instance_runs_inside_sequential(self):
        lin = randomized(ops.Linear(8, 8, dtype=D, device="cpu"))
        model = ops.Sequential(ops.GELU(), lin)
        x = torch.randn(2, 8, dtype=D)
        h = torch.nn.functional.gelu(x, approximate="tanh")
        torch.testing.assert_close(model(x), torch.nn.functional.linear(h, lin.weight, lin.bias))
        plain = lin.forward
        lin.forward = lambda x: plain(x) * 3  # accelerate's add_hook_to_module does this
        torch.testing.assert_close(
            model(x), 3 * torch.nn.functional.linear(h, lin.weight, lin.bias)
        )
        del lin.forward  # and its remove_hook_from_module
        torch.testing.assert_close(model(x), torch.nn.functional.linear(h, lin.weight, lin.bias))

    def test_a_child_set_through_modules_takes_effect(self):
        """torch.ao.quantization's convert assigns module._modules[key] directly."""
        model = ops.Sequential(ops.Linear(8, 8, dtype=D, device="cpu"), ops.GELU())
        x = torch.randn(3, 8, dtype=D)
        model(x)
        model._modules["1"] = ops.ReLU()
        torch.testing.assert_close(model(x), torch.relu(model[0](x)))
        # A shallow copy shares the dict: a child set through the copy changes both.
        twin = copy.copy(model)
        twin[1] = torch.nn.Tanh()
        torch.testing.assert_close(model(x), torch.tanh(model[0](x)))

    def test_quantize_dynamic_replaces_a_torch_linear_between_ops(self):
        torch.manual_seed(0)
        model = ops.Sequential(ops.LayerNorm(8, device="cpu"), torch.nn.Linear(8, 8), ops.GELU())
        x = torch.randn(4, 8)
        model(x)
        torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )
        seen = []
        model[1].register_forward_hook(lambda m, a, out: seen.append(out))
        y = model(x)
        assert len(seen) == 1  # the quantized Linear ran
        h = torch.nn.functional.layer_norm(x, (8,), model[0].weight, model[0].bias, model[0].eps)
        torch.testing.assert_close(y, torch.nn.functional.gelu(model[1](h), approximate="tanh"))

    def test_a_subclass_forward_runs_inside_sequential(self):
        class Doubled(ops.Linear):
            def forward(self, x):
                return super().forward(x) * 2

        lin = randomized(Doubled(8, 8, dtype=D, device="cpu"))
        x = torch.randn(3, 8, dtype=D, requires_grad=True)
        model = ops.Sequential(ops.GELU(), lin, ops.ReLU())
        y = model(x)
        h = torch.nn.functional.gelu(x, approximate="tanh")
        want = torch.relu(2 * torch.nn.functional.linear(h, lin.weight, lin.bias))
        torch.testing.assert_close(y, want)
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, lin.weight, lin.bias], dy)
        torch.testing.assert_close(got, torch.autograd.grad(want, [x, lin.weight, lin.bias], dy))
        assert [g.get("module") for g in model.fusion_plan()] == [None, "Doubled", None]


class TestInPlaceResidual:
    @pytest.mark.parametrize("mlp", [False, True])
    def test_residual_that_is_also_the_input(self, mlp):
        """y = x + f(x) called as seq(x, x) with AddExtraInput(in_place=True): an op before the
        add saved x for its backward, so the add runs out of place and the gradients are right."""
        torch.manual_seed(1)
        body = [m for m in _mlp()] if mlp else [ops.GELU()]  # LayerNorm, Linear, GELU, Linear
        model = ops.Sequential(*body, ops.AddExtraInput(in_place=True))
        for p in model.parameters():
            torch.nn.init.normal_(p)
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        h = x * 1  # a non-leaf, as a residual stream is
        y = model(h, h)
        dy = torch.randn_like(y)
        y.backward(dy)
        r = x.detach().requires_grad_()
        params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        with torch.no_grad():
            for p, q in zip(model.parameters(), params):
                q.copy_(p)
        f = r
        if mlp:
            lw, lb, w1, b1, w2, b2 = params
            f = torch.nn.functional.layer_norm(r, (8,), lw, lb, body[0].eps)
            f = torch.nn.functional.gelu(f @ w1.T + b1, approximate="tanh") @ w2.T + b2
        else:
            f = torch.nn.functional.gelu(r, approximate="tanh")
        want = r + f
        want.backward(dy)
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(x.grad, r.grad)
        for p, q in zip(model.parameters(), params):
            torch.testing.assert_close(p.grad, q.grad)

    @pytest.mark.parametrize("between", [None, "bias", "gelu"])
    def test_residual_that_is_a_saved_frozen_parameter(self, between):
        """The in-place add's extra tensor is the frozen weight the linear before it saved for
        its backward: the add runs out of place (fused with the linear or not), and the weight
        and the input gradient stay right."""
        torch.manual_seed(2)
        lin = randomized(ops.BasicLinear(4, 4, dtype=D, device="cpu"))
        bias = randomized(ops.Bias(4, dtype=D, device="cpu"))
        middle = {None: [], "bias": [bias], "gelu": [ops.GELU()]}[between]
        model = ops.Sequential(lin, *middle, ops.AddExtraInput(in_place=True))
        lin.weight.requires_grad_(False)
        w = lin.weight.detach().clone()
        x = torch.randn(4, 4, dtype=D, requires_grad=True)
        y = model(x, lin.weight)
        dy = torch.randn_like(y)
        y.backward(dy)
        r = x.detach().requires_grad_()
        h = r @ w.T
        h = {
            None: h,
            "bias": h + bias.bias,
            "gelu": torch.nn.functional.gelu(h, approximate="tanh"),
        }[between]
        want = h + w
        want.backward(dy)
        assert torch.equal(lin.weight, w)
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(x.grad, r.grad)


class TestCompile:
    @pytest.mark.parametrize("backend", ["eager", "inductor"])
    def test_compile_fresh_model(self, backend):
        torch._dynamo.reset()
        model = _mlp(channels=True)
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend=backend)
        x = torch.randn(4, 8, dtype=D, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = compiled(x), ref(x_ref)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
        y.sum().backward()
        y_ref.sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


class TestRepr:
    def test_reprs(self):
        assert repr(ops.Linear(8, 4)) == "Linear(in_features=8, out_features=4, bias=True)"
        assert (
            repr(ops.Linear(8, 4, bias=False))
            == "Linear(in_features=8, out_features=4, bias=False)"
        )
        assert (
            repr(ops.LayerNorm(8))
            == "LayerNorm(normalized_shape=(8,), eps=1e-05, zero_centered_gamma=False)"
        )
        assert repr(ops.GELU()) == "GELU()"
        assert repr(ops.ConstantScale(0.5)) == "ConstantScale(scale=0.5)"
        assert "(1): Linear(in_features=8, out_features=16, bias=True)" in repr(_mlp())

    def test_docstrings(self):
        for name in ops.__all__:
            obj = getattr(ops, name)
            if callable(obj):
                assert obj.__doc__ and len(obj.__doc__.strip()) > 10, name
        assert "in_features" in ops.Linear.__doc__ and "Args" in ops.LayerNorm.__doc__

    def test_concrete_cpp_classes(self):
        from fusible import _C

        assert type(ops.GELU()._cpp) is _C.GELU and type(ops.SwiGLU()._cpp) is _C.SwiGLU


@pytest.mark.parametrize("device", DEVICES)
def test_per_call_parameters_on_device(device):
    lin = ops.Linear(8, 4, device=device)
    x = torch.randn(3, 8, device=device)
    w = torch.nn.Parameter(torch.randn(4, 8, device=device))
    y = torch.func.functional_call(lin, {"weight": w}, (x,))
    torch.testing.assert_close(y, x @ w.T + lin.bias, rtol=1e-3, atol=1e-5)


class TestFSDP2:
    def test_fully_shard_one_process_matches_unsharded_step(self, tmp_path):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
        )
        try:
            model = _mlp(channels=True)
            ref = copy.deepcopy(model)
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            assert all(type(p).__name__ == "DTensor" for p in model.parameters())
            x = torch.randn(4, 8, dtype=D, device="cpu")
            for m in (model, ref):
                opt = torch.optim.SGD(m.parameters(), lr=0.1)
                m(x).square().sum().backward()
                opt.step()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert p.device.type == "cpu", name
                torch.testing.assert_close(p.full_tensor(), q)
            torch.testing.assert_close(model(x), ref(x))
        finally:
            dist.destroy_process_group()


class TestExportAndTrace:
    def test_export_lifts_parameters_and_follows_load_state_dict(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        ep = torch.export.export(model, (x,))
        lifted = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"]
        assert sorted(lifted) == sorted(k for k, _ in model.named_parameters())
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        buf.seek(0)
        reloaded = torch.export.load(buf).module()
        torch.testing.assert_close(reloaded(x), model(x), rtol=0, atol=0)
        new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        reloaded.load_state_dict(new)
        model.load_state_dict(new)
        torch.testing.assert_close(reloaded(x), model(x), rtol=0, atol=0)

    def test_jit_trace(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D, device="cpu")
        traced = torch.jit.trace(model, (x,), check_trace=False)
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


def test_swapped_in_parameter_of_wrong_shape_is_a_clear_error():
    lin = ops.Linear(8, 4, dtype=D, device="cpu")
    with pytest.raises(RuntimeError, match=r"BasicLinear: expected parameter 'weight' of shape"):
        torch.func.functional_call(
            lin,
            {"weight": torch.zeros(4, 7, dtype=D, device="cpu")},
            (torch.ones(2, 8, dtype=D, device="cpu"),),
        )


class TestReviewRegressions:
    def test_plain_call_follows_a_channel_change(self):
        make = ops.MakeExtraOutput()
        x = torch.randn(2, 3, dtype=D)
        y, extra = make(x)
        assert torch.equal(y, x) and torch.equal(extra, x)
        make.set_extra_output_channel(0, "hidden", output_to_caller=False)
        y = make(x)  # the output is hidden now: y alone
        assert isinstance(y, torch.Tensor) and torch.equal(y, x)

    def test_pre_hook_that_sets_the_weight_takes_effect(self):
        model = _mlp()
        x = torch.randn(3, 8, dtype=D)
        zeros = torch.nn.Parameter(torch.zeros(16, 8, dtype=D))

        def swap(module, args):
            module.weight = zeros

        model[1].register_forward_pre_hook(swap)
        h = model[0](x)
        y = model(x)
        fc2 = model[3]
        ref = fc2(model[2](torch.zeros(3, 16, dtype=D) + model[1].bias))
        torch.testing.assert_close(y, ref)
        y.sum().backward()
        assert zeros.grad is not None and h.shape == (3, 8)

    def test_copy_keeps_eval_mode(self):
        model = ops.Sequential(ops.Dropout(0.5)).eval()
        clone = copy.deepcopy(model)
        x = torch.randn(64, dtype=D)
        assert not clone[0].training
        torch.testing.assert_close(clone(x), x, rtol=0, atol=0)


def test_a_parameter_assigned_to_a_linears_basic_op_is_the_linears():
    # te.ops' route (lin.basic_ops[0].weight = p): the Linear computes with it, reports it and
    # trains it; a copy's basic ops assign to the copy.
    torch.manual_seed(3)
    lin = ops.Linear(4, 3, dtype=D, device="cpu")
    x = torch.randn(5, 4, dtype=D)
    w = torch.nn.Parameter(torch.randn(3, 4, dtype=D))
    b = torch.nn.Parameter(torch.randn(3, dtype=D))
    lin.basic_ops[0].weight, lin.basic_ops[1].bias = w, b
    assert lin.weight is w and lin.bias is b and list(lin.parameters()) == [w, b]
    torch.testing.assert_close(lin(x), x @ w.T + b, rtol=0, atol=0)
    lin(x).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 3, dtype=D).T @ x)
    twin = copy.deepcopy(lin)
    twin.basic_ops[0].weight = torch.nn.Parameter(torch.zeros(3, 4, dtype=D))
    torch.testing.assert_close(twin(x), b.detach().expand(5, 3), rtol=0, atol=0)
    assert lin.weight is w  # the original is untouched


def test_a_parametrization_on_a_linears_basic_op_is_refused_before_anything_changes():
    lin = ops.Linear(4, 3, dtype=D, device="cpu")
    with torch.no_grad():
        lin.bias.uniform_(-1, 1)
    weight = lin.weight
    with pytest.raises(RuntimeError, match="reparametrize it on the Linear"):
        torch.nn.utils.parametrize.register_parametrization(
            lin.basic_ops[0], "weight", torch.nn.Identity()
        )
    assert lin.basic_ops[0].weight is weight and lin.weight is weight
    assert not torch.nn.utils.parametrize.is_parametrized(lin.basic_ops[0])
    x = torch.randn(2, 4, dtype=D)
    torch.testing.assert_close(lin(x), x @ weight.T + lin.bias, rtol=0, atol=0)


def test_a_hook_on_a_linears_basic_op_is_refused():
    """The Linear computes its basic ops without calling their forward: a hook on one would be
    kept and never run. Refused (te.ops ignores it); a standalone basic op's hooks run."""
    lin = ops.Linear(4, 3, dtype=D, device="cpu")
    calls = []
    registers = [
        lambda m: m.register_forward_pre_hook(lambda *a: calls.append(a)),
        lambda m: m.register_forward_hook(lambda *a: calls.append(a)),
        lambda m: m.register_full_backward_pre_hook(lambda *a: calls.append(a)),
        lambda m: m.register_full_backward_hook(lambda *a: calls.append(a)),
    ]
    for register in registers:
        for op in lin.basic_ops:
            with pytest.raises(RuntimeError, match="register it on the Linear instead"):
                register(op)
    for register in registers:
        register(lin)
    lin(torch.randn(2, 4, dtype=D, requires_grad=True)).sum().backward()
    assert len(calls) == 4
    alone = ops.BasicLinear(4, 3, dtype=D, device="cpu")
    alone.register_forward_hook(lambda *a: calls.append(a))
    alone(torch.randn(2, 4, dtype=D))
    assert len(calls) == 5


def test_register_parameter_keeps_a_linear_and_its_basic_ops_together():
    """register_parameter (what torch utilities call, bypassing setattr) on a basic op or on the
    Linear: the other side follows, as for assignment."""
    torch.manual_seed(4)
    lin = randomized(ops.Linear(4, 3, dtype=D, device="cpu"))
    x = torch.randn(5, 4, dtype=D)
    w = torch.nn.Parameter(torch.randn(3, 4, dtype=D))
    lin.basic_ops[0].register_parameter("weight", w)
    assert lin.weight is w
    torch.testing.assert_close(lin(x), x @ w.T + lin.bias, rtol=0, atol=0)
    b = torch.nn.Parameter(torch.randn(3, dtype=D))
    lin.register_parameter("bias", b)
    assert lin.basic_ops[1].bias is b
    torch.testing.assert_close(lin(x), x @ w.T + b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot remove parameter 'bias'"):
        lin.register_parameter("bias", None)
    assert lin.bias is b


@pytest.mark.parametrize("kind", ["prune", "weight_norm"])
def test_prune_on_a_linears_basic_op_is_refused_and_the_linear_still_computes(kind):
    """prune and the old weight_norm remove the basic op's weight from _parameters directly: the
    Linear would have kept computing with the unpruned weight. Refused; prune on the Linear
    itself works."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(5)
    lin = randomized(ops.Linear(8, 4, dtype=D, device="cpu"))
    weight = lin.weight
    with pytest.raises(RuntimeError, match="prune or reparametrize it on the Linear"):
        if kind == "prune":
            prune.l1_unstructured(lin.basic_ops[0], "weight", amount=0.5)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm
                torch.nn.utils.weight_norm(lin.basic_ops[0], "weight", dim=None)
    assert list(lin.basic_ops[0]._parameters) == ["weight"]  # nothing of the attempt's
    assert lin.basic_ops[0]._parameters["weight"] is weight and lin.weight is weight
    lin.basic_ops[0].bias = torch.zeros(4, dtype=D)  # not a parameter of the BasicLinear: allowed
    assert list(lin.basic_ops[0]._parameters) == ["weight"]
    x = torch.randn(3, 8, dtype=D)
    torch.testing.assert_close(lin(x), x @ weight.T + lin.bias, rtol=0, atol=0)
    prune.l1_unstructured(lin, "weight", amount=0.5)
    masked = lin.weight_orig * lin.weight_mask
    torch.testing.assert_close(lin(x), x @ masked.T + lin.bias, rtol=0, atol=0)

"""Fault injection (issue 17): exceptions, KeyboardInterrupt, malformed results and CUDA
out-of-memory raised in the middle of a call. After each one the same model (the same module
objects) must compute the float64 reference again, forward and every gradient; hold exactly the
channel locks it held before; leave the fusion registry as it was; plan as a fresh model does."""

import copy
import faulthandler
import gc
import threading

import fusible
import fusible.recipe
import pytest
import torch
import torch.nn.functional as F
from conftest import FP8_GEMM_DEVICES, cuda_only, randomized, tols
from fusible import _C, ops
from fusible.ops import fusion_registry

D = torch.float64
CONTAINERS = ["sequential", "operation_fuser"]
JOIN_TIMEOUT_S = 30


@pytest.fixture(autouse=True)
def isolated_registry():
    snap = ops.snapshot_fusions()
    yield
    ops.restore_fusions(snap)


@pytest.fixture(autouse=True)
def no_hang():
    # A deadlock fails the run with every thread's traceback instead of hanging CI.
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _raise(exc_type, message):
    # A new exception per raise: one kept by a test parameter would keep, through its traceback,
    # the failed call's frames and so the model alive.
    def fault(*_):
        raise exc_type(message)

    return fault


class Faulty(ops.BasicOperation):
    """y = w * x with a learnable scalar w. A test arms a fault on its forward, backward or
    pre_first_fuser_forward: a function of the correct result that returns what the op returns
    instead, or raises."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(1.25, dtype=D))
        self.forward_fault = self.backward_fault = self.first_call_fault = None
        self.first_calls = 0

    def pre_first_fuser_forward(self):
        self.first_calls += 1
        if self.first_call_fault:
            self.first_call_fault()

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        y = self.w * input_
        return self.forward_fault(y) if self.forward_fault else y

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        result = (self.w * grad_output, [(grad_output * x).sum()])
        return self.backward_fault(result) if self.backward_fault else result

    def disarm(self):
        self.forward_fault = self.backward_fault = self.first_call_fault = None


# ---- the model: a residual routed by a channel, fused linears, a Python op in the middle
def _ops(linear_device="cpu"):
    make = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
    add = ops.AddExtraInput().set_extra_input_channel(0, "res")
    lin1 = ops.Linear(4, 8, device=linear_device, dtype=D)
    lin2 = ops.Linear(8, 4, device=linear_device, dtype=D)
    return [make, lin1, ops.GELU(), Faulty(), lin2, add]


def _build(container, op_list):
    if container == "sequential":
        return ops.Sequential(*op_list)
    return ops.OperationFuser(op_list)


def _reference(op_list, x):
    _, lin1, _, faulty, lin2, _ = op_list
    h = F.gelu(F.linear(x, lin1.weight, lin1.bias), approximate="tanh")
    return F.linear(faulty.w * h, lin2.weight, lin2.bias) + x


def _params(op_list):
    return list(dict.fromkeys(p for op in op_list for p in op.parameters()))


def _basic_ops(op_list):
    return [b for op in op_list for b in op._basic_op_list()]


def _x(grad=True):
    return torch.randn(3, 4, dtype=D, requires_grad=grad)


def _assert_computes_reference(model, op_list):
    """Forward, every gradient and a no-grad call against the float64 reference."""
    x = _x()
    params = _params(op_list)
    y = model(x)
    xr = x.detach().requires_grad_()
    ref = _reference(op_list, xr)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], dy)
    want = torch.autograd.grad(ref, [xr, *params], dy)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref.detach(), rtol=1e-12, atol=1e-12)


def _state(op_list):
    """What a failed call must leave as it found: channel locks and the fusion registry (the C++
    entries by id, and the Python functions behind them)."""
    return (
        [op.channels_locked for op in _basic_ops(op_list)],
        [entry.id for entry in _C.snapshot_fusions()],
        {f: list(ids) for f, ids in fusion_registry._ids.items()},
    )


def _assert_plans_like_a_fresh_model(container, model):
    """The plan of the model's next grad call is what a fresh model of the same ops plans."""
    fresh = _build(container, _ops())
    for m in (model, fresh):
        m(_x())
    assert model.fusion_plan() == fresh.fusion_plan()


def _assert_unlocked(op_list):
    """Once its model is dropped, no op is locked: a failed call leaked no lock."""
    gc.collect()
    assert not any(op.channels_locked for op in _basic_ops(op_list))


def _warm_model(container):
    """A model that has run (plans made, channels locked) and computes the reference."""
    op_list = _ops()
    model = _build(container, op_list)
    _assert_computes_reference(model, op_list)
    return op_list, model


def _grad_call(model):
    x = _x()
    y = model(x)
    return torch.autograd.grad(y, [x], torch.randn_like(y))


# (fault slot, fault, expected exception, message)
USER_CODE_FAULTS = [
    pytest.param(
        "forward_fault",
        _raise(ValueError, "injected forward failure"),
        ValueError,
        "^injected forward failure$",
        id="forward-raises",
    ),
    pytest.param(
        "backward_fault",
        _raise(ValueError, "injected backward failure"),
        ValueError,
        "^injected backward failure$",
        id="backward-raises",
    ),
    pytest.param(
        "forward_fault",
        _raise(KeyboardInterrupt, "injected forward interrupt"),
        KeyboardInterrupt,
        "^injected forward interrupt$",
        id="forward-keyboard-interrupt",
    ),
    pytest.param(
        "backward_fault",
        _raise(KeyboardInterrupt, "injected backward interrupt"),
        KeyboardInterrupt,
        "^injected backward interrupt$",
        id="backward-keyboard-interrupt",
    ),
    # A forward cannot know an op's output shape (ops may reshape): the next op names the shape.
    pytest.param(
        "forward_fault",
        lambda y: y[..., :-1],
        RuntimeError,
        r"BasicLinear: expected input\.size\(-1\) == in_features \(8\), got 7",
        id="forward-wrong-shape",
    ),
    pytest.param(
        "forward_fault",
        lambda y: 3,
        TypeError,
        r"Faulty\.op_forward: expected a tensor",
        id="forward-non-tensor",
    ),
    pytest.param(
        "forward_fault",
        lambda y: (y, y),
        TypeError,
        r"Faulty\.op_forward: expected a tensor or None, got <class 'tuple'>",
        id="forward-two-outputs",
    ),
    pytest.param(
        "forward_fault",
        lambda y: None,
        RuntimeError,
        "Faulty: forward returned no output tensor",
        id="forward-none",
    ),
    pytest.param(
        "backward_fault",
        lambda r: (*r, None),
        TypeError,
        r"Faulty\.op_backward \(grad_input, parameter grads\): expected a tuple of 2 entries",
        id="backward-three-outputs",
    ),
    pytest.param(
        "backward_fault",
        lambda r: (r[0], []),
        ValueError,
        r"Faulty\.op_backward parameter grads: expected 1 entries, got 0",
        id="backward-missing-parameter-grad",
    ),
    pytest.param(
        "backward_fault",
        lambda r: ("dx", r[1]),
        TypeError,
        r"Faulty\.op_backward grad_input: expected a tensor",
        id="backward-non-tensor-grad-input",
    ),
    pytest.param(
        "backward_fault",
        lambda r: (r[0], [3.0]),
        TypeError,
        r"Faulty\.op_backward parameter grads: expected tensors or None",
        id="backward-non-tensor-parameter-grad",
    ),
    pytest.param(
        "backward_fault",
        lambda r: (r[0][:1], r[1]),
        RuntimeError,
        r"Faulty.*\[1, 8\].*\[3, 8\]",
        id="backward-wrong-shape-grad-input",
    ),
    pytest.param(
        "backward_fault",
        lambda r: (r[0], [torch.stack([r[1][0], r[1][0]])]),
        RuntimeError,
        r"Faulty.*\[2\]",
        id="backward-wrong-shape-parameter-grad",
    ),
]


class TestUserCodeFaults:
    @pytest.mark.parametrize("slot,fault,exc,match", USER_CODE_FAULTS)
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_fault_reaches_the_caller_and_the_model_recovers(
        self, container, slot, fault, exc, match
    ):
        op_list, model = _warm_model(container)
        faulty = op_list[3]
        before = _state(op_list)
        setattr(faulty, slot, fault)
        if slot == "forward_fault":
            with pytest.raises(exc, match=match):
                model(_x())
        else:
            x = _x()
            y = model(x)  # the forward is untouched
            with pytest.raises(exc, match=match):
                torch.autograd.grad(y, [x], torch.randn_like(y))
        faulty.disarm()
        assert _state(op_list) == before
        _assert_computes_reference(model, op_list)
        _assert_plans_like_a_fresh_model(container, model)
        del model
        _assert_unlocked(op_list)

    def test_broadcastable_wrong_grad_input_is_not_summed_silently(self):
        # ConstantScale passes any gradient shape on, so only the fuser can catch this one.
        faulty = Faulty()
        model = ops.Sequential(ops.ConstantScale(2.0), faulty)
        faulty.backward_fault = lambda r: (r[0].expand(2, *r[0].shape), r[1])
        with pytest.raises(RuntimeError, match="Faulty"):
            _grad_call(model)

    def test_many_faults_in_a_row_leave_no_lock_behind(self):
        op_list, model = _warm_model("sequential")
        faulty = op_list[3]
        for k in range(10):
            faulty.forward_fault = _raise(ValueError, f"failure {k}")
            with pytest.raises(ValueError, match=f"^failure {k}$"):
                model(_x())
            faulty.disarm()
            faulty.backward_fault = _raise(ValueError, f"failure {k}")
            with pytest.raises(ValueError, match=f"^failure {k}$"):
                _grad_call(model)
            faulty.disarm()
        _assert_computes_reference(model, op_list)
        del model
        _assert_unlocked(op_list)


class TestFirstCallFaults:
    @pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_pre_first_fuser_forward_raises(self, container, exc):
        op_list = _ops()
        model = _build(container, op_list)
        faulty = op_list[3]
        before = _state(op_list)
        faulty.first_call_fault = _raise(exc, "injected first-call failure")
        with pytest.raises(exc, match="^injected first-call failure$"):
            model(_x())
        faulty.disarm()
        assert _state(op_list) == before
        _assert_computes_reference(model, op_list)
        assert faulty.first_calls == 2  # retried once, as it never completed; then not again
        _assert_plans_like_a_fresh_model(container, model)

    @pytest.mark.parametrize("stage", ["first_call_fault", "forward_fault", "backward_fault"])
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_failed_first_call_on_meta_leaves_usable_parameters(self, container, stage):
        op_list = _ops(linear_device="meta")
        model = _build(container, op_list)
        faulty = op_list[3]
        params = _params(op_list)
        setattr(faulty, stage, _raise(ValueError, "injected failure"))
        with pytest.raises(ValueError, match="^injected failure$"):
            _grad_call(model)
        faulty.disarm()
        linears = [op_list[1], op_list[4]]
        for linear in linears:
            _assert_meta_or_default_initialized(linear)
        materialized = [(p, p.detach().clone()) for p in params if not p.is_meta]
        _assert_computes_reference(model, op_list)
        assert _params(op_list) == params  # the same Parameter objects, now real
        for linear in linears:
            _assert_meta_or_default_initialized(linear)
            assert not linear.weight.is_meta
        for p, value in materialized:  # what the failed call materialized is not reset again
            assert torch.equal(p.detach(), value)

    def test_failed_reset_during_materialization_is_retried(self):
        value = 1.0 + torch.rand(()).item()  # drawn now: no freed buffer can hold it by chance
        op = MetaScale(value)
        model = ops.Sequential(op, ops.ConstantScale(2.0))
        x = torch.randn(3, 4, dtype=D)
        op.fail_reset = True
        with pytest.raises(RuntimeError, match="^injected reset failure$"):
            model(x)
        assert op.w.is_meta  # as before the call, not real and uninitialized
        op.fail_reset = False
        y = model(x)
        assert torch.equal(op.w.detach(), torch.full((4,), value, dtype=D))
        torch.testing.assert_close(y, 2.0 * value * x, rtol=0, atol=0)


def _assert_meta_or_default_initialized(linear):
    """Default init, torch.nn.Linear's for weights: |weight| <= 1/sqrt(in_features), bias zero."""
    weight, bias = linear.weight, linear.bias
    if weight.is_meta:
        assert bias.is_meta
        return
    bound = linear.weight.shape[1] ** -0.5
    assert bool((weight.detach().abs() <= bound).all())
    assert torch.equal(bias.detach(), torch.zeros_like(bias))


class MetaScale(ops.BasicOperation):
    """y = w * x, w built on meta; reset_parameters fills w with `value`, or fails when asked."""

    def __init__(self, value):
        super().__init__()
        self.value = value
        self.fail_reset = False
        self.w = torch.nn.Parameter(torch.empty(4, dtype=D, device="meta"))

    def reset_parameters(self):
        if self.fail_reset:
            raise RuntimeError("injected reset failure")
        with torch.no_grad():
            self.w.fill_(self.value)

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return self.w * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return self.w * grad_output, [(grad_output * x).sum(0)]


# ---- fusion functions and the fused ops they make
class GeluScale(ops.FusedOperation):
    """Joint fusion of GELU + Faulty: y = w * gelu(x); raises where `GeluScale.fault` says."""

    fault = None

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        self._maybe_fail("forward")
        basic_op_ctxs[0].save_for_backward(input_)
        return self._w() * F.gelu(input_, approximate="tanh"), [[], []]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        self._maybe_fail("backward")
        (x,) = basic_op_ctxs[0].saved_tensors
        with torch.enable_grad():
            xr = x.detach().requires_grad_()
            h = F.gelu(xr, approximate="tanh")
            (dx,) = torch.autograd.grad(h, [xr], self._w() * grad_output)
        dw = (grad_output * h.detach()).sum()
        return dx, [[], [dw]], [[], []]

    def _w(self):
        return self.basic_ops[1].w.detach()

    def _maybe_fail(self, direction):
        if GeluScale.fault == direction:
            raise ValueError(f"injected fused {direction} failure")


def fuse_gelu_scale(op_list, *, recipe):
    out, i = [], 0
    while i < len(op_list):
        if isinstance(op_list[i], ops.GELU) and i + 1 < len(op_list):
            if isinstance(op_list[i + 1], Faulty):
                out.append(GeluScale(op_list[i : i + 2]))
                i += 2
                continue
        out.append(op_list[i])
        i += 1
    return out


REGISTRATIONS = [
    ops.register_forward_fusion,
    ops.register_backward_fusion,
    ops.register_forward_backward_fusion,
]


class TestFusionFaults:
    @pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
    @pytest.mark.parametrize("register", REGISTRATIONS, ids=lambda f: f.__name__)
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_fusion_function_raises(self, container, register, exc):
        armed = {"on": False}
        fail = _raise(exc, "injected fusion failure")

        def flaky_fusion(op_list, *, recipe):
            if armed["on"]:
                fail()
            return op_list

        op_list, model = _warm_model(container)
        register(flaky_fusion)  # a registry change: the next call plans again
        before = _state(op_list)
        armed["on"] = True
        with pytest.raises(exc, match="^injected fusion failure$"):
            model(_x())
        armed["on"] = False
        assert _state(op_list) == before
        _assert_computes_reference(model, op_list)
        _assert_plans_like_a_fresh_model(container, model)
        del model
        _assert_unlocked(op_list)

    @pytest.mark.parametrize("direction", ["forward", "backward"])
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_python_fused_op_raises(self, container, direction):
        ops.register_forward_backward_fusion(fuse_gelu_scale)
        op_list, model = _warm_model(container)
        assert "GeluScale" in model.fusion_plan()[0]["forward"]
        before = _state(op_list)
        GeluScale.fault = direction
        try:
            with pytest.raises(ValueError, match=f"^injected fused {direction} failure$"):
                _grad_call(model)
        finally:
            GeluScale.fault = None
        assert _state(op_list) == before
        _assert_computes_reference(model, op_list)
        _assert_plans_like_a_fresh_model(container, model)
        del model
        _assert_unlocked(op_list)


class TestChannelWiringFaults:
    def test_failed_grouping_takes_no_lock(self):
        add = ops.AddExtraInput().set_extra_input_channel(0, "missing")
        op_list = [ops.Linear(4, 4, device="cpu", dtype=D), add]
        model = ops.Sequential(*op_list)
        with pytest.raises(ValueError, match="'missing'.*has no producer"):
            model(_x())
        assert not any(op.channels_locked for op in _basic_ops(op_list))
        add.set_extra_input_channel(0, None)  # unlocked: the wiring can still be changed
        x, r = _x(), _x()
        lin = op_list[0]
        torch.testing.assert_close(model(x, r), F.linear(x, lin.weight, lin.bias) + r)


class TestThreads:
    @pytest.mark.parametrize("container", CONTAINERS)
    def test_failure_in_one_thread_while_another_runs(self, container):
        op_list, model = _warm_model(container)  # first calls single-threaded
        faulty = op_list[3]
        errors, armed = [], {}
        failing = threading.Thread(target=_fail_repeatedly, args=(model, armed, errors))
        working = threading.Thread(target=_compute_repeatedly, args=(model, op_list, errors))
        faulty.forward_fault = _in_thread(failing, armed, "forward")
        faulty.backward_fault = _in_thread(failing, armed, "backward")
        before = _state(op_list)
        for t in (failing, working):
            t.daemon = True  # a hung thread must not keep the test process alive
            t.start()
        for t in (failing, working):
            t.join(JOIN_TIMEOUT_S)
        assert not failing.is_alive() and not working.is_alive(), "deadlock: a thread hangs"
        assert not errors, errors[0]
        faulty.disarm()
        assert _state(op_list) == before
        _assert_computes_reference(model, op_list)
        del model
        _assert_unlocked(op_list)


def _in_thread(thread, armed, stage):
    """A fault that raises in `thread` alone, while armed["stage"] is `stage`."""

    def fault(result):
        if threading.current_thread() is thread and armed.get("stage") == stage:
            raise ValueError(f"injected {stage} failure")
        return result

    return fault


def _fail_repeatedly(model, armed, errors):
    try:
        for _ in range(30):
            for stage in ("forward", "backward"):
                armed["stage"] = stage
                with pytest.raises(ValueError, match=f"^injected {stage} failure$"):
                    _grad_call(model)
    except BaseException as e:  # reported by the test's main thread
        errors.append(e)


def _compute_repeatedly(model, op_list, errors):
    try:
        for _ in range(30):
            _assert_computes_reference(model, op_list)
    except BaseException as e:
        errors.append(e)


@cuda_only
class TestCudaOutOfMemory:
    """A real CUDA out-of-memory: the allocator is capped just above what is in use (activations
    here are 64 MiB each, the headroom 16 MiB), so the next large allocation fails."""

    ROWS, HIDDEN = 8192, 2048
    HEADROOM = 16 << 20

    def _model(self):
        torch.manual_seed(0)
        return ops.Sequential(
            ops.Linear(self.HIDDEN, self.HIDDEN, device="cuda"),
            ops.GELU(),
            ops.Linear(self.HIDDEN, self.HIDDEN, device="cuda"),
        )

    def _inputs(self):
        g = torch.Generator(device="cuda").manual_seed(1)
        shape = (self.ROWS, self.HIDDEN)
        x = torch.randn(shape, device="cuda", generator=g)
        return x, torch.randn(shape, device="cuda", generator=g)

    def _run(self, model, x, dy):
        x = x.detach().requires_grad_()
        y = model(x)
        return [y.detach(), *torch.autograd.grad(y, [x, *model.parameters()], dy)]

    def _cap_memory_near_use(self):
        """Caps the allocator at what it holds now plus HEADROOM; returns the previous fraction."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        previous = torch.cuda.get_per_process_memory_fraction()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(
            (torch.cuda.memory_reserved() + self.HEADROOM) / total
        )
        return previous

    def _uncap(self, previous):
        torch.cuda.set_per_process_memory_fraction(previous)
        torch.cuda.empty_cache()

    def _assert_same_results(self, got, want):
        rtol, atol = tols(torch.float32, gemm=True, device="cuda")
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)

    def _assert_trains_like(self, model, twin, x, dy):
        """Three SGD steps of the model and of its never-faulted twin give the same parameters."""
        opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (model, twin)]
        for _ in range(3):
            for m, opt in zip((model, twin), opts):
                opt.zero_grad()
                m(x).backward(dy)
                opt.step()
        self._assert_same_results(list(model.parameters()), list(twin.parameters()))

    @pytest.mark.parametrize("during", ["forward", "backward"])
    def test_out_of_memory_then_trains(self, during):
        model = self._model()
        twin = copy.deepcopy(model)
        op_list = list(model)
        x, dy = self._inputs()
        expected = self._run(model, x, dy)  # warm: plans, cuBLAS handles and workspaces exist
        before = _state(op_list)
        if during == "forward":
            previous = self._cap_memory_near_use()
            try:
                with pytest.raises(torch.OutOfMemoryError):
                    model(x.detach().requires_grad_())
            finally:
                self._uncap(previous)
        else:
            xg = x.detach().requires_grad_()
            y = model(xg)  # uncapped: the forward's activations are held for the backward
            previous = self._cap_memory_near_use()
            try:
                with pytest.raises(torch.OutOfMemoryError):
                    torch.autograd.grad(y, [xg, *model.parameters()], dy)
            finally:
                self._uncap(previous)
            del y, xg
        assert _state(op_list) == before
        self._assert_same_results(self._run(model, x, dy), expected)
        self._assert_trains_like(model, twin, x, dy)


def _fp8_states(op_list):
    return [_C._fp8_state(b._cpp) for b in _basic_ops(op_list)]


def _assert_same_fp8_states(a, b):
    assert len(a) == len(b)
    for sa, sb in zip(a, b, strict=True):
        assert (sa is None) == (sb is None)
        if sa is not None:
            for d in ("forward", "backward"):
                for (ha, ca), (hb, cb) in zip(sa[d], sb[d], strict=True):
                    assert torch.equal(ha, hb) and torch.equal(ca, cb)


class TestDelayedScalingState:
    """Under DelayedScaling each cast rolls its op's amax history and sets its next scale as the
    forward runs. A call that raises part way (here: an extra input of the wrong shape in the last
    op, after both linears cast) puts them back, in the failing group and in groups before it, so
    the next calls compute as those of a model that never saw the failed one."""

    @staticmethod
    def _model(kind, device="cpu"):
        lin1 = randomized(ops.Linear(16, 32, device=device))
        lin2 = randomized(ops.Linear(32, 16, device=device))
        if kind == "two_groups":  # a plain module splits the Sequential into two fusers
            op_list = [lin1, torch.nn.Tanh(), lin2, ops.AddExtraInput()]
            return [lin1, lin2, op_list[-1]], ops.Sequential(*op_list)
        op_list = [lin1, ops.GELU(), lin2, ops.AddExtraInput()]
        return op_list, _build(kind, op_list)

    @pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
    @pytest.mark.parametrize("kind", [*CONTAINERS, "two_groups"])
    @pytest.mark.parametrize("warm", [True, False], ids=["warm", "first_call"])
    def test_a_failed_call_leaves_the_fp8_state_as_it_was(self, kind, warm, device):
        torch.manual_seed(5)
        op_list, model = self._model(kind, device)
        r = fusible.recipe.DelayedScaling(amax_history_len=3)
        x, res = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
        if warm:
            with fusible.autocast(recipe=r):
                model(x, res).sum().backward()
        twin_list, twin = copy.deepcopy((op_list, model))
        before = copy.deepcopy(_fp8_states(op_list))
        with fusible.autocast(recipe=r), pytest.raises(RuntimeError, match="AddExtraInput"):
            model(
                x * 40, torch.randn(8, 5, device=device)
            )  # a larger amax: the casts would record it
        _assert_same_fp8_states(_fp8_states(op_list), before)

        # Two optimizer steps after it: the same outputs, parameters and state as the twin's.
        def train(m, ol):
            opt = torch.optim.SGD(_params(ol), lr=0.1)
            outputs = []
            for step in range(2):
                opt.zero_grad()
                with fusible.autocast(recipe=r):
                    y = m(x + step, res)
                y.square().sum().backward()
                opt.step()
                outputs.append(y.detach())
            return outputs, [p.detach() for p in _params(ol)], _fp8_states(ol)

        got, want = train(model, op_list), train(twin, twin_list)
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        _assert_same_fp8_states(got[2], want[2])

    def test_a_state_not_made_by_the_failed_call_stays_none(self):
        op_list, model = self._model("sequential")
        with (
            fusible.autocast(recipe=fusible.recipe.DelayedScaling()),
            pytest.raises(RuntimeError),
        ):
            model(torch.randn(4, 16), torch.randn(4, 3))
        assert all(s is None for s in _fp8_states(op_list))

    def test_the_benchmark_switch_turns_the_rollback_off(self):
        """fusible._C._set_fp8_state_rollback(False) (for measuring the snapshot's cost) keeps the
        failed call's updates, as before the rollback existed."""
        op_list, model = self._model("sequential")
        assert _C._fp8_state_rollback()
        _C._set_fp8_state_rollback(False)
        try:
            with (
                fusible.autocast(recipe=fusible.recipe.DelayedScaling()),
                pytest.raises(RuntimeError),
            ):
                model(torch.randn(4, 16), torch.randn(4, 3))
        finally:
            _C._set_fp8_state_rollback(True)
        linears = (op_list[0], op_list[2])
        assert all(_C._fp8_state(lin.basic_ops[0]._cpp) is not None for lin in linears)

    @pytest.mark.parametrize("how", ["nested_sequential", "subclass", "twice"])
    def test_ops_in_plain_steps_and_nested_models_are_put_back(self, how):
        """Ops that run inside a plain step of the failing Sequential (a nested Sequential, a
        subclass whose forward calls the op's): the inner call succeeds and hands its snapshot
        to the outer one, which puts it back when a later op raises; one op twice in a model."""

        class MyLinear(ops.Linear):
            def forward(self, x):
                return super().forward(x)

        torch.manual_seed(2)
        lin1 = randomized(ops.Linear(16, 16))
        lin2 = randomized(MyLinear(16, 16) if how == "subclass" else ops.Linear(16, 16))
        if how == "nested_sequential":
            model = ops.Sequential(lin1, ops.Sequential(lin2), ops.AddExtraInput())
        elif how == "subclass":
            model = ops.Sequential(lin1, lin2, ops.AddExtraInput())
        else:
            model = ops.Sequential(lin1, lin2, lin1, ops.AddExtraInput())
        op_list = [lin1, lin2]
        r = fusible.recipe.DelayedScaling(amax_history_len=3)
        x = torch.randn(8, 16)
        with fusible.autocast(recipe=r):
            model(x, torch.randn(8, 16))
        before = copy.deepcopy(_fp8_states(op_list))
        with fusible.autocast(recipe=r), pytest.raises(RuntimeError, match="AddExtraInput"):
            model(x * 40, torch.randn(8, 5))
        _assert_same_fp8_states(_fp8_states(op_list), before)
        # The inner model alone, failing on its own, is put back too.
        with fusible.autocast(recipe=r), pytest.raises(RuntimeError):
            ops.Sequential(lin2, ops.AddExtraInput())(x * 40, torch.randn(8, 5))
        _assert_same_fp8_states(_fp8_states(op_list), before)

    def test_an_inner_failure_caught_by_user_code_stays_put_back(self):
        """A plain step runs a model, then runs it again with a bad extra input and catches the
        error; the outer call succeeds: the caught call's casts are put back all the same (the
        model ends as a twin that made only the good call)."""
        torch.manual_seed(4)
        inner = ops.Sequential(randomized(ops.Linear(16, 16)), ops.AddExtraInput())
        twin = copy.deepcopy(inner)
        x = torch.randn(8, 16)

        class Retry(torch.nn.Module):
            def forward(self, h):
                y = inner(h, torch.zeros(8, 16))
                with pytest.raises(RuntimeError, match="AddExtraInput"):
                    inner(h * 40, torch.randn(8, 5))
                return y

        with fusible.autocast(recipe=fusible.recipe.DelayedScaling(amax_history_len=3)):
            ops.Sequential(Retry(), ops.GELU())(x)
            twin(x, torch.zeros(8, 16))
        _assert_same_fp8_states(_fp8_states([inner[0]]), _fp8_states([twin[0]]))

    def test_a_state_loaded_under_inference_mode_is_put_back(self):
        """Serving: the FP8 state loaded under torch.inference_mode (inference tensors), a call
        there that raises: put back inside inference mode (a plain copy_ would be refused)."""
        op_list, model = self._model("sequential")
        r = fusible.recipe.DelayedScaling(amax_history_len=3)
        with fusible.autocast(recipe=r):
            model(torch.randn(4, 16), torch.randn(4, 16))
        sd = copy.deepcopy(model.state_dict())
        with torch.inference_mode():
            model.load_state_dict(sd)
            before = copy.deepcopy(_fp8_states(op_list))
            with fusible.autocast(recipe=r), pytest.raises(RuntimeError, match="AddExtraInput"):
                model(torch.randn(4, 16) * 40, torch.randn(4, 3))
            _assert_same_fp8_states(_fp8_states(op_list), before)

    def test_a_meta_model_with_fp8_state_deep_copies(self):
        """A deferred (meta) Linear that ran under DelayedScaling holds meta FP8 state: its copy
        loads it without reading values (the checkpoint's scale check skips meta tensors)."""
        lin = ops.Linear(16, 16, device="meta")
        with fusible.autocast(recipe=fusible.recipe.DelayedScaling()):
            lin(torch.randn(4, 16, device="meta"))
        copied = copy.deepcopy(lin)
        state = _C._fp8_state(copied.basic_ops[0]._cpp)
        assert state is not None and state["forward"][0][1].is_meta

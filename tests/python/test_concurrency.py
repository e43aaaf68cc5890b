"""Concurrency (issue 17): one model and distinct models run forward and backward from several
threads (the bindings release the GIL inside a fuser call, so the threads really overlap), also
while another thread registers and removes fusions. No crash, no deadlock, and every result equal
to a single-threaded run. Scenarios that can crash the process run in a child process."""

import copy
import faulthandler
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import tols
from fusible import ops

THREADS, ITERATIONS = 4, 20
JOIN_TIMEOUT_S = 30
CHILD_TIMEOUT_S = 35
CHURN_SECONDS = 3.0
MODES = ["grad", "no_grad", "mixed"]  # mixed: grad and no-grad calls alternate, so plans change


@pytest.fixture(autouse=True)
def no_hang():
    # A deadlock fails the run with every thread's traceback instead of hanging CI.
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    # The threads under test are the callers'. Intra-op threads on top of them oversubscribe a
    # small CI machine (a step then takes 100x longer) and add nothing to what is tested.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


class LearnableScale(ops.BasicOperation):
    """y = w * x, written in Python: its calls take the GIL back in the middle of a fuser call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.75))

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return self.w.detach() * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return self.w.detach() * grad_output, [(grad_output * x).sum()]


def _model():
    """Fused linears, a Python op, a torch module splitting two fuser groups and a residual routed
    across them by a channel."""
    make = ops.MakeExtraOutput().set_extra_output_channel(0, "res", output_to_caller=False)
    add = ops.AddExtraInput().set_extra_input_channel(0, "res")
    return ops.Sequential(
        make,
        ops.Linear(16, 32, device="cpu"),
        ops.GELU(),
        LearnableScale(),
        ops.ConstantScale(0.5),
        ops.ConstantScale(4.0),
        torch.nn.Tanh(),
        ops.LayerNorm(32, device="cpu"),
        ops.Linear(32, 16, device="cpu"),
        add,
    )


def _inputs(seed, rows=8, cols=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)


def _grad_mode(mode, i):
    return mode == "grad" or (mode == "mixed" and i % 2 == 0)


def _step(model, x, dy, grad):
    """[y] without grad; [y, dx, one gradient per parameter] with it (autograd.grad: threads
    sharing a model must not accumulate into its .grad)."""
    if not grad:
        with torch.no_grad():
            return [model(x)]
    x = x.detach().requires_grad_()
    y = model(x)
    return [y.detach(), *torch.autograd.grad(y, [x, *model.parameters()], dy)]


def _steps(model, thread, mode):
    return [
        _step(model, *_inputs(1000 * thread + i), _grad_mode(mode, i)) for i in range(ITERATIONS)
    ]


def _run_threads(targets):
    """Runs each target in its own thread; returns their results, raises the first error."""
    results, errors = [None] * len(targets), []
    start = threading.Barrier(len(targets))  # all begin together, so the calls overlap

    def run(k):
        try:
            start.wait(JOIN_TIMEOUT_S)
            results[k] = targets[k]()
        except BaseException as e:  # reported by the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread hangs"
    if errors:
        raise errors[0]
    return results


def _assert_bitwise_equal(got, want):
    for steps_got, steps_want in zip(got, want, strict=True):
        for tensors_got, tensors_want in zip(steps_got, steps_want, strict=True):
            for g, w in zip(tensors_got, tensors_want, strict=True):
                assert torch.equal(g, w)


class TestThreads:
    @pytest.mark.parametrize("mode", MODES)
    def test_one_model_from_threads(self, mode):
        model = _model()
        expected = [_steps(model, t, mode) for t in range(THREADS)]  # also the first call
        got = _run_threads([lambda t=t: _steps(model, t, mode) for t in range(THREADS)])
        _assert_bitwise_equal(got, expected)

    @pytest.mark.parametrize("mode", MODES)
    def test_distinct_models_from_threads(self, mode):
        models = [_model() for _ in range(THREADS)]
        twins = [copy.deepcopy(m) for m in models]  # the copies compute what the models do
        expected = [_steps(twins[t], t, mode) for t in range(THREADS)]
        # The models' first calls (grouping, planning) run in the threads, concurrently.
        got = _run_threads([lambda t=t: _steps(models[t], t, mode) for t in range(THREADS)])
        _assert_bitwise_equal(got, expected)

    def test_first_calls_run_pre_first_fuser_forward_once(self):
        # An OperationFuser: its C++ side is built before the first call, so only the Python
        # pre-forward hooks are under test (a Sequential's grouping: TestThreadsInAChildProcess).
        for _ in range(10):
            op = SlowFirstCall()
            fuser = ops.OperationFuser([ops.Linear(16, 16, device="cpu"), op])
            x = _inputs(0)[0]
            outputs = _run_threads([lambda: fuser(x).detach()] * THREADS)
            assert op.first_calls == 1
            assert all(torch.equal(y, outputs[0]) for y in outputs)


class SlowFirstCall(ops.BasicOperation):
    """y = 2x; its pre_first_fuser_forward counts its calls and sleeps, which lets other threads
    run while it is in progress."""

    def __init__(self):
        super().__init__()
        self.first_calls = 0

    def pre_first_fuser_forward(self):
        self.first_calls += 1
        time.sleep(0.002)

    def op_forward(self, ctx, input_, **unused):
        return 2 * input_

    def op_backward(self, ctx, grad_output):
        return 2 * grad_output, []


# ---- scenarios that can crash the process (they did) run in a child process
def _run_child(scenario, *args):
    code = f"import test_concurrency as t; t.{scenario}(*{args!r})"
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    output = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "scenario passed" in proc.stdout, output


def _child_setup():
    torch.set_num_threads(1)  # as the one_intra_op_thread fixture
    faulthandler.dump_traceback_later(CHILD_TIMEOUT_S - 15, exit=True)  # a hang fails, with stacks


def first_calls_from_threads(num_models):
    """THREADS threads make the very first call of one model at the same moment, model after
    model (no-grad and grad calls in turn); each gets what a copy of the model computes alone."""
    _child_setup()
    models = [_model() for _ in range(num_models)]
    inputs = [_inputs(k) for k in range(num_models)]  # made before: the calls start together
    grads = [k % 2 == 1 for k in range(num_models)]
    expected = [_step(copy.deepcopy(m), *xs, grad) for m, xs, grad in zip(models, inputs, grads)]
    barrier = threading.Barrier(THREADS)

    def first_calls():
        out = []
        try:
            for model, xs, grad in zip(models, inputs, grads):
                barrier.wait(JOIN_TIMEOUT_S)
                out.append(_step(model, *xs, grad))
        except BaseException:
            barrier.abort()  # the other threads stop waiting for this one
            raise
        return out

    for got in _run_threads([first_calls] * THREADS):
        _assert_bitwise_equal([got], [expected])
    print("scenario passed")


class ScalePair(ops.FusedOperation):
    """ConstantScale(a) + ConstantScale(b) as one op: y = (a * b) * x, in both directions."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        return self._k() * input_, [[], []]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        return self._k() * grad_output, [[], []], [[], []]

    def _k(self):
        return self.basic_ops[0].scale * self.basic_ops[1].scale


def fuse_scale_pair(op_list, *, recipe):
    """Matches two ConstantScales in a row: the plan changes, the results do not."""
    out, i = [], 0
    while i < len(op_list):
        pair = op_list[i : i + 2]
        if len(pair) == 2 and all(isinstance(op, ops.ConstantScale) for op in pair):
            out.append(ScalePair(pair))
            i += 2
        else:
            out.append(op_list[i])
            i += 1
    return out


def keep_ops(op_list, *, recipe):
    """Matches everything and changes nothing."""
    return list(op_list)


def _change_fusions_until(stop):
    """Registers fusions (many, some prepended, one that matches) and restores the registry, until
    `stop` is set."""
    while not stop.is_set():
        snap = ops.snapshot_fusions()
        for k in range(64):
            ops.register_backward_fusion(keep_ops, prepend=k % 2 == 0)
        ops.register_forward_backward_fusion(fuse_scale_pair)
        ops.unregister_fusion(keep_ops)
        ops.register_forward_fusion(keep_ops)
        ops.restore_fusions(snap)
        # Let the model threads in: a registry that changes between every call re-plans every
        # call, and each plan waits for the GIL this loop holds (slow, not stuck).
        time.sleep(0.002)


def _small_model():
    """Small, so that calls (and the re-planning each registry change causes) come fast."""
    return ops.Sequential(
        ops.Linear(4, 4, device="cpu"), ops.GELU(), ops.ConstantScale(0.5), ops.ConstantScale(4.0)
    )


def _calls_until(deadline, model, steps, expected):
    """Repeats the steps until `deadline`: each a grad call, then no-grad calls (every switch
    re-plans), all within tolerance of `expected`."""
    rtol, atol = tols(torch.float32, gemm=True)
    while time.monotonic() < deadline:
        for (x, dy), want in zip(steps, expected):
            got = _step(model, x, dy, grad=True)
            assert all(torch.allclose(g, w, rtol=rtol, atol=atol) for g, w in zip(got, want))
            for _ in range(8):
                with torch.no_grad():
                    assert torch.allclose(model(x), want[0], rtol=rtol, atol=atol)


def models_while_fusions_change(seconds):
    """Threads 0 and 1 share one model, threads 2 and 3 have one each, while another thread keeps
    changing the fusion registry; every result matches a single-threaded run of a copy."""
    _child_setup()
    shared = _small_model()
    models = [shared, shared] + [_small_model() for _ in range(THREADS - 2)]
    steps = [
        [_inputs(1000 * t + i, rows=3, cols=4) for i in range(ITERATIONS)] for t in range(THREADS)
    ]
    expected = []
    for model, inputs in zip(models, steps):
        twin = copy.deepcopy(model)
        expected.append([_step(twin, x, dy, grad=True) for x, dy in inputs])
    stop = threading.Event()
    changer = threading.Thread(target=_change_fusions_until, args=(stop,), daemon=True)
    changer.start()
    deadline = time.monotonic() + seconds
    try:
        _run_threads(
            [
                lambda t=t: _calls_until(deadline, models[t], steps[t], expected[t])
                for t in range(THREADS)
            ]
        )
    finally:
        stop.set()
        changer.join(JOIN_TIMEOUT_S)
    assert not changer.is_alive(), "deadlock: the registering thread hangs"
    print("scenario passed")


class TestThreadsInAChildProcess:
    # Crashed (SIGSEGV, once a hang) until Sequential built its groups under a lock
    # (csrc/fuser/sequential.cpp): calls run without the GIL.
    def test_first_calls_of_one_model_from_threads(self):
        _run_child("first_calls_from_threads", 200)

    def test_models_while_fusions_change(self):
        _run_child("models_while_fusions_change", CHURN_SECONDS)

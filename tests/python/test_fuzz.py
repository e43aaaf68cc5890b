"""Differential fuzzing (issue 17), the fixed-seed slice for CI: random chains of every basic op
against the unfused float64 reference (fuzz_chains.py), one test per seed, on CPU and (a smaller
slice) on CUDA; the slice's coverage of ops and fusions, so that a shrinking fuzzer fails; a wrong
reference is caught; and the fusible bugs the fuzzer found, as regression tests.
Longer runs with random seeds: scripts/fuzz.sh --minutes N."""

import collections

import fuzz_chains
import pytest
import torch
from conftest import cuda_only
from fusible import ops
from fuzz_chains import CaseFailure, make_case, run_case
from op_specs import GROUPED_SPECS, SPECS

D = torch.float64
CPU_SEEDS = range(1000)  # about a minute on a 2-core CPU
CUDA_SEEDS = range(150)

_fusions_by_seed = {}  # CPU seed -> the fusions its case used (read by TestCoverage)


@pytest.mark.parametrize("seed", CPU_SEEDS, ids=lambda seed: f"seed{seed}")
def test_cpu_case(seed):
    _fusions_by_seed[seed] = run_case(make_case(seed, "cpu"))


@cuda_only
@pytest.mark.parametrize("seed", CUDA_SEEDS, ids=lambda seed: f"seed{seed}")
def test_cuda_case(seed):
    run_case(make_case(seed, "cuda"))


class TestCoverage:
    COLLECTIVES = {"AllGather", "AllReduce", "ReduceScatter"}  # need a process group

    def test_op_specs_cover_every_basic_op(self):
        """Every basic op class of fusible.ops has a spec (collectives: test_tensor_parallel.py)."""
        exported = {
            name
            for name in ops.__all__
            if isinstance(getattr(ops, name), type)
            and issubclass(getattr(ops, name), ops.BasicOperation)
            and name != "BasicOperation"
        }
        made = set()
        for spec in SPECS + GROUPED_SPECS:
            op = spec.make("meta", D)
            made |= {type(m).__name__ for m in op.modules()}
        assert exported - made == self.COLLECTIVES

    def test_the_slice_generates_every_spec(self):
        generated = collections.Counter(
            step.spec.name for seed in CPU_SEEDS for step in make_case(seed).steps
        )
        assert set(fuzz_chains.CATALOGUE) - set(generated) == set()
        assert min(generated.values()) >= 5, generated

    def test_the_slice_exercises_every_fusion(self):
        """Built-in and Python fusions, read from the plans of the slice's cases (those that
        test_cpu_case ran, else run here)."""
        counts = collections.Counter()
        for seed in CPU_SEEDS:
            if seed not in _fusions_by_seed:
                try:
                    _fusions_by_seed[seed] = run_case(make_case(seed))
                except CaseFailure:
                    continue  # test_cpu_case reports it
            counts.update(_fusions_by_seed[seed])
        markers = {fuzz_chains.REDRAWN, fuzz_chains.OUT_OF_RANGE}
        assert set(counts) - markers == fuzz_chains.KNOWN_FUSIONS
        assert min(counts[name] for name in fuzz_chains.KNOWN_FUSIONS) >= 3, counts


class TestSensitivity:
    """A reference that is slightly off makes cases fail: the comparison is not vacuous."""

    def _case_with(self, op_name, dtypes=(torch.float32, torch.float64)):
        for seed in range(10_000):
            case = make_case(seed)
            if (
                case.dtype in dtypes
                and case.x_grad
                and "grad" in case.calls
                and case.steps[0].spec.name == op_name
            ):
                return case
        raise AssertionError(f"no case starts with {op_name}")

    def test_a_wrong_value_fails(self, monkeypatch):
        case = self._case_with("ConstantScale")
        monkeypatch.setattr(
            fuzz_chains.CATALOGUE["ConstantScale"], "ref", lambda x, p, e: 0.3701 * x
        )
        with pytest.raises(
            CaseFailure, match=r"\n(y|extra output \d+): Tensor-likes are not close"
        ):
            run_case(case)

    def test_a_wrong_gradient_fails(self, monkeypatch):
        case = self._case_with("ConstantScale")

        def right_value_wrong_gradient(x, p, e):
            return 0.37 * x + 1e-3 * (x - x.detach())

        monkeypatch.setattr(
            fuzz_chains.CATALOGUE["ConstantScale"], "ref", right_value_wrong_gradient
        )
        with pytest.raises(CaseFailure, match=r"\ngrad x: Tensor-likes are not close"):
            run_case(case)

    def test_elements_the_dtype_cannot_hold_are_not_compared(self, monkeypatch):
        # Found by a CUDA run (seed 1183102948, fp16): the reference rounded to fp16 as the unfused
        # chain must round overflows in places, so its rounding noise there is not finite and no
        # tolerance judges them (the fuzzer compared with atol=nan and raised).
        compared = collections.Counter()  # result name -> elements compared
        compare = fuzz_chains._compare

        def counting_compare(case, what, got, want, noise):
            compared[what] += want.numel()
            return compare(case, what, got, want, noise)

        monkeypatch.setattr(fuzz_chains, "_compare", counting_compare)
        assert fuzz_chains.OUT_OF_RANGE in run_case(make_case(1183102948))
        # The results were still compared, in the elements the dtype holds (op 2's weight1
        # gradient has one element just past 65504; op 0's gradients pass it everywhere).
        for name in ("y", "grad x", "grad op 2 weight1"):
            assert compared[name] > 0, compared


class TestFoundBugs:
    """The fusible bugs the fuzzer found, minimized by hand, as regression tests. All were
    in-place adds writing where they should not, or autograd refusing what they wrote.

    AddExtraInput(in_place=True) writes only into a positional extra tensor of the caller
    (OperationContext::extra_input_writable, csrc/fuser/operation_fuser.cpp). It wrote into
    every channel value too: one made in an earlier fuser group (MakeExtraOutput hands out its
    input itself, so the caller's x) and a channel_inputs tensor that other slots also read.

    GroupedLinear saved a 2-D view of its input made inside the fuser's forward (grad mode off);
    when that input was a caller's tensor written in place and returned (MakeExtraOutput), the
    fuser marked it dirty and autograd refused the view. It saves the input itself now.

    Views: marking a view dirty rebased its history onto the node's first input (x), so x's
    gradient was lost silently, or an internal assert fired after a Linear. An in-place add into
    a view adds out of place (AddExtraInput::writes_in_place)."""

    @staticmethod
    def _across_a_plain_module():
        make = ops.MakeExtraOutput().set_extra_output_channel(0, "r", output_to_caller=False)
        add = ops.AddExtraInput(in_place=True).set_extra_input_channel(0, "r")
        return ops.Sequential(make, torch.nn.Tanh(), add)

    def test_in_place_add_across_fuser_groups_keeps_x(self):
        x = torch.full((4,), 0.5, dtype=D)
        y = self._across_a_plain_module()(x)
        torch.testing.assert_close(y, torch.full((4,), 0.5, dtype=D).tanh() + 0.5)
        assert torch.equal(x, torch.full((4,), 0.5, dtype=D))  # held y before the fix

    def test_in_place_add_across_fuser_groups_with_grad(self):
        # Raised "a view ... is being modified inplace" until an in-place add into a view (here the
        # first group's extra output) became an out-of-place add.
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        y = self._across_a_plain_module()(x)
        (g,) = torch.autograd.grad(y, [x], torch.ones_like(y))
        torch.testing.assert_close(g, 1 - torch.tanh(x.detach()) ** 2 + 1)

    def test_in_place_add_into_a_shared_channel_input(self):
        first = ops.AddExtraInput(in_place=True).set_extra_input_channel(0, "r")
        second = ops.AddExtraInput().set_extra_input_channel(0, "r")
        seq = ops.Sequential(ops.ConstantScale(2.0), first, ops.ConstantScale(3.0), second)
        x, r = torch.ones(4, dtype=D), torch.full((4,), 10.0, dtype=D)
        y = seq(x, channel_inputs={"r": r})
        # Both consumers read the caller's r: (2 + 10) * 3 + 10; the second gets the first's sum.
        torch.testing.assert_close(y, torch.full((4,), 46.0, dtype=D))  # was 48
        assert torch.equal(r, torch.full((4,), 10.0, dtype=D))

    def test_in_place_add_into_a_view_keeps_the_gradient_of_x(self):
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        residual = torch.randn(4, 4, dtype=D)[1:]  # a view: rows 1.. of a buffer
        ops.AddExtraInput(in_place=True)(x, residual).sum().backward()
        torch.testing.assert_close(x.grad, torch.ones_like(x))  # was None, with no error

    def test_in_place_add_into_a_view_after_a_linear(self):
        seq = ops.Sequential(
            ops.Linear(4, 4, device="cpu", dtype=D), ops.AddExtraInput(in_place=True)
        )
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        residual = torch.randn(4, 4, dtype=D)[1:]
        y = seq(x, residual)
        # Raised "fn_edge.is_valid() == this_edge.is_valid() INTERNAL ASSERT FAILED".
        dx, _ = torch.autograd.grad(y.sum(), [x, seq[0].weight])
        torch.testing.assert_close(dx, torch.ones(3, 4, dtype=D) @ seq[0].weight.detach())

    def test_in_place_add_then_extra_output_then_grouped_linear(self):
        # The residual pattern of a MoE block: h = x + r in r's storage, r = h, then the experts.
        seq = ops.Sequential(
            ops.AddExtraInput(in_place=True),
            ops.MakeExtraOutput(),
            ops.GroupedLinear(3, 8, 8, device="cpu", dtype=D),
        )
        x, r = torch.randn(5, 8, dtype=D), torch.randn(5, 8, dtype=D)
        expected = x + r
        # Raised "A view was created in no_grad mode and its base ... modified inplace".
        y, residual = seq(x, r, torch.tensor([2, 1, 2]))
        torch.testing.assert_close(residual, expected)
        assert residual.data_ptr() == r.data_ptr()  # in place: te.ops' semantics
        grouped, rows = seq[2], expected.split([2, 1, 2])
        weights = [getattr(grouped, f"weight{i}") for i in range(3)]
        biases = [getattr(grouped, f"bias{i}") for i in range(3)]
        reference = torch.cat([rows[i] @ weights[i].T + biases[i] for i in range(3)])
        torch.testing.assert_close(y, reference)
        y.sum().backward()  # the saved input, reshaped in the backward
        for weight, x_g in zip(weights, rows):
            torch.testing.assert_close(weight.grad, torch.ones(8, len(x_g), dtype=D) @ x_g)

    def test_a_wrong_shaped_extra_gradient_is_not_broadcast(self):
        # A forward-only Python fusion over ConstantScale + AddExtraInput cannot record the
        # broadcast in AddExtraInput's context (ctx.state is C++-private), so the unfused backward
        # returns the extra input's gradient at x's shape; accumulate() (csrc/fuser/fuser_run.cpp)
        # adds it to the other consumer's by broadcasting: grad r is 42, not 12, and no error.
        class ScaleAddForward(ops.FusedOperation):
            def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
                extra = basic_op_extra_inputs[1][0]
                return self.basic_ops[0].scale * input_ + extra, [[], []]

        def fuse(ops_list, *, recipe):
            scale, add = ops_list[:2] if len(ops_list) > 2 else (None, None)
            if isinstance(scale, ops.ConstantScale) and isinstance(add, ops.AddExtraInput):
                return [ScaleAddForward([scale, add]), *ops_list[2:]]
            return ops_list

        snapshot = ops.snapshot_fusions()
        ops.register_forward_fusion(fuse)
        try:
            first = ops.AddExtraInput().set_extra_input_channel(0, "r")
            second = ops.AddExtraInput().set_extra_input_channel(0, "r")
            seq = ops.Sequential(ops.ConstantScale(2.0), first, second)
            r = torch.randn(4, dtype=D, requires_grad=True)  # broadcast over x's [2, 3, 4]
            y = seq(torch.randn(2, 3, 4, dtype=D), channel_inputs={"r": r})
            try:
                (g,) = torch.autograd.grad(y.sum(), [r])
            except (RuntimeError, ValueError):
                return  # refusing the wrong-shaped gradient is a fix too
            torch.testing.assert_close(g, torch.full((4,), 12.0, dtype=D))  # got 42
        finally:
            ops.restore_fusions(snapshot)

"""Determinism: with torch.use_deterministic_algorithms(True), two training runs in separate
processes end with bit-identical parameters (CUDA: the demo MLP in fp32, bf16 and FP8, and the
fused MoE expert MLP; CPU: the demo in fp32). fusible's own kernels use no floating-point atomics
(bias, norm and grouped-bias gradients are fixed-order two-pass sums; the FP8 amax is an atomic
max, which is order-free). Two CUDA runs differed until CUDA parameters followed a seed set before
Python's first CUDA call (each process had drawn its Linear weights from a randomly seeded
generator). A nondeterministic PyTorch op called inside a fused call raises PyTorch's own error."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import cuda_only
from fusible import ops

HERE = os.path.dirname(os.path.abspath(__file__))


def _train(device, out, steps):
    # cuBLAS (the demo's own torch matmul) needs a fixed workspace to be deterministic.
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, os.path.join(HERE, "train_determinism.py"), str(out)]
    r = subprocess.run(
        [*cmd, "--device", device, "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return torch.load(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_two_training_runs_are_bit_identical(device, tmp_path):
    steps = 50
    first = _train(device, tmp_path / "a.pt", steps)
    second = _train(device, tmp_path / "b.pt", steps)
    expected = {"demo_fp32"}
    if device == "cuda":
        expected |= {"demo_bf16", "moe_bf16"}
    assert expected <= set(first) and set(first) == set(second)
    for run, params in first.items():
        assert params.keys() == second[run].keys()
        for name, value in params.items():
            assert torch.equal(value, second[run][name]), f"{run}: {name} differs"
    # Training moved the parameters (a run that did nothing would be trivially identical).
    untrained = _train(device, tmp_path / "c.pt", 0)
    for run, params in first.items():
        assert any(not torch.equal(v, untrained[run][k]) for k, v in params.items()), run


_FRESH_PROCESS_INIT = """
import torch
from fusible import ops
torch.manual_seed(0)  # before any CUDA call of Python's
made = {"cuda": ops.Linear(8, 8, device="cuda").weight, "default": ops.Linear(8, 8).weight}
meta = ops.Linear(8, 8, device="meta")
meta.reset_parameters()  # materialized on the CUDA device by C++
made["meta"] = meta.weight
print({k: v.detach().cpu().tolist() for k, v in made.items()})
"""


@cuda_only
def test_cuda_parameters_follow_a_seed_set_before_the_first_cuda_call():
    # Python applies such a seed to the CUDA generators when it sets CUDA up; C++ allocating
    # CUDA parameters does not set it up, and two processes initialized them differently.
    runs = [
        subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS_INIT], capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stdout + r.stderr
    assert runs[0].stdout == runs[1].stdout
    assert len(set(runs[0].stdout.split("],"))) > 1  # values, not one repeated row


class _Histogram(ops.BasicOperation):
    """y = x, after torch.histc of x, which has no deterministic CUDA kernel."""

    def op_forward(self, ctx, input_, **unused):
        torch.histc(input_.float(), bins=4)
        return input_.clone()

    def op_backward(self, ctx, grad_output):
        return grad_output, ()


@cuda_only
def test_nondeterministic_torch_op_inside_a_fused_call_raises_pytorch_error():
    seq = ops.Sequential(ops.Linear(8, 8, device="cuda"), _Histogram())
    x = torch.randn(4, 8, device="cuda")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
            seq(x)
    finally:
        torch.use_deterministic_algorithms(previous)
    y = seq(x)  # the model still runs once the mode is off
    torch.testing.assert_close(y, seq[0](x))

"""FP8 features gated by the GPU's compute capability: per-tensor FP8 GEMMs from 8.9, block-scaled
ones on Hopper (9.x) only. The decision for each capability (mocked: the machine's GPU, if any,
is not asked), what fusible.fp8_available() and fp8_block_scaling_available() report, and, on a
GPU that has the features, that a Linear under an FP8 recipe launches no FP8 GEMM when the
capability is overridden to one that lacks them (the recipe is emulated instead, with a
warning)."""

import contextlib
import warnings

import fusible
import pytest
import torch
from conftest import cuda_only
from fusible import _C, ops, recipe

# (major, minor) -> (per-tensor FP8 GEMMs, block-scaled FP8 GEMMs)
CAPABILITIES = {
    (7, 5): (False, False),
    (8, 0): (False, False),
    (8, 6): (False, False),
    (8, 9): (True, False),
    (9, 0): (True, True),
    (10, 0): (True, False),
    (12, 0): (True, False),
}


@contextlib.contextmanager
def capability(major, minor):
    _C._set_cuda_capability_override(major, minor)
    try:
        yield
    finally:
        _C._set_cuda_capability_override(-1, 0)


@pytest.mark.parametrize("cc", list(CAPABILITIES), ids=lambda cc: f"sm{cc[0]}{cc[1]}")
def test_the_decision_for_each_capability(cc):
    want_tensor, want_block = CAPABILITIES[cc]
    ok, why = _C._fp8_gemm_support(*cc, False)
    assert ok == want_tensor and (why == "") == ok
    if not ok:
        assert "compute capability 8.9 or newer" in why and f"{cc[0]}.{cc[1]}" in why
    ok, why = _C._fp8_gemm_support(*cc, True)
    assert ok == want_block and (why == "") == ok
    if not ok and want_tensor:
        assert "Hopper" in why and f"{cc[0]}.{cc[1]}" in why


@pytest.mark.parametrize("cc", list(CAPABILITIES), ids=lambda cc: f"sm{cc[0]}{cc[1]}")
def test_fp8_available_reports_the_mocked_gpu(cc, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_C, "cuda_built", True)
    want_tensor, want_block = CAPABILITIES[cc]
    with capability(*cc):
        assert fusible.fp8_available()[0] == want_tensor
        assert fusible.fp8_block_scaling_available()[0] == want_block
        assert _C._cuda_capability() == cc


def test_fp8_available_without_a_gpu_or_cuda_kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fusible.fp8_available() == (False, "FP8 needs a CUDA GPU; none is available")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_C, "cuda_built", False)
    with capability(9, 0):
        assert fusible.fp8_block_scaling_available() == (
            False,
            "fusible was built without CUDA kernels",
        )


def _kernel_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("fusible::")}


@cuda_only
@pytest.mark.parametrize(
    "cc, rec",
    [((8, 0), recipe.Float8CurrentScaling), ((10, 0), recipe.Float8BlockScaling)],
    ids=["sm80-current", "sm100-block"],
)
def test_a_gpu_without_the_feature_runs_no_fp8_gemm(cc, rec, capfd):
    block = rec is recipe.Float8BlockScaling
    if not (fusible.fp8_block_scaling_available() if block else fusible.fp8_available())[0]:
        pytest.skip("this GPU lacks the feature itself: nothing to take away")
    torch.manual_seed(0)
    lin = ops.Linear(64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run():
        with fusible.autocast(recipe=rec()):
            lin(x).sum().backward()

    assert "fusible::fp8_gemm" in _kernel_ops(run)  # this GPU has the feature
    warn_always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # the warning is once per process otherwise
    capfd.readouterr()
    try:
        with capability(*cc), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = _kernel_ops(run)
    finally:
        torch.set_warn_always(warn_always)
    assert "fusible::fp8_gemm" not in names, names
    # The C++ warning reaches Python's warnings or, outside a warning handler, stderr.
    said = capfd.readouterr().err + " ".join(str(w.message) for w in caught)
    assert "casts are emulated" in said and f"{cc[0]}.{cc[1]}" in said, said
    assert any(n.startswith("fusible::fp8_quantize_dequantize") for n in names), names

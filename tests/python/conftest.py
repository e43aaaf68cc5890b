"""Shared pytest fixtures and helpers: devices (CUDA skipped, never faked), the tolerances against
a float64 reference, a log of the fusible ops and dtype conversions a call dispatches."""

import fusible  # noqa: F401  (registers torch.ops.fusible)
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")

DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def _gpu_lacks(check):
    return not HAS_CUDA or not check()[0]


# Devices for tests that assert FP8 GEMM kernels run: CUDA where this GPU runs them (elsewhere the
# recipe is emulated, which other tests cover).
FP8_GEMM_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            _gpu_lacks(fusible.fp8_available), reason="no GPU here that runs FP8 GEMMs"
        ),
    ),
]
FP8_BLOCK_GEMM_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            _gpu_lacks(fusible.fp8_block_scaling_available),
            reason="no GPU here that runs block-scaled FP8 GEMMs",
        ),
    ),
]

# (rtol, atol) against a float64 reference, by (dtype, whether a GEMM is involved).
TOLERANCES = {
    (torch.float64, False): (1e-12, 1e-12),
    (torch.float64, True): (1e-12, 1e-12),
    (torch.float32, False): (1.3e-6, 1e-5),
    (torch.float32, True): (1e-4, 1e-5),
    (torch.float16, False): (1e-3, 1e-5),
    (torch.float16, True): (1e-3, 1e-5),
    (torch.bfloat16, False): (1.6e-2, 1e-5),
    (torch.bfloat16, True): (1.6e-2, 1e-5),
}


def tols(dtype, gemm=False, device="cpu"):
    rtol, atol = TOLERANCES[(dtype, gemm)]
    if dtype == torch.float32 and gemm and str(device).startswith("cuda"):
        rtol = 1e-3  # TF32 allowed on CUDA
    return rtol, atol


def assert_close_to_ref(actual, ref64, dtype, gemm=False):
    """actual (computed in dtype) against a float64 reference rounded to dtype."""
    rtol, atol = tols(dtype, gemm, actual.device)
    torch.testing.assert_close(
        actual.detach().double().cpu(),
        ref64.detach().to(dtype).double().cpu(),
        rtol=rtol,
        atol=atol,
    )


def randomized(module, scale=0.3):
    """Every parameter random and nonzero, biases included (a zero default hides errors)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale + 0.01)
    return module


class OpLog(TorchDispatchMode):
    """The fusible ops and dtype conversions a call dispatches, with their tensors' dtypes."""

    def __enter__(self):
        self.calls = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("fusible.") or name in ("aten.to", "aten._to_copy"):
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.calls.append((name, dtypes))
        return func(*args, **(kwargs or {}))

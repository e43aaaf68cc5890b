"""`python -m fusible`: an environment report for bug reports (as `python -m
torch.utils.collect_env`): fusible's version and build, torch's, CUDA's and the driver's, each GPU
with its compute capability, and whether FP8 runs here."""

import platform
import shutil
import subprocess
import sys

import torch

import fusible
from fusible import _C


def driver_version():
    """The NVIDIA driver's version as nvidia-smi reports it, or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return out.stdout.split("\n")[0].strip() or f"unknown (nvidia-smi: {out.stderr.strip()})"


def report():
    """The report's lines."""
    lines = [
        f"fusible: {fusible.__version__} (C++ library {_C.version}) at {fusible.__file__}",
        f"  CUDA kernels built: {'yes, for ' + _C.cuda_archs if fusible.cuda_built else 'no'}",
        f"torch: {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"python: {sys.version.split()[0]} on {platform.platform()}",
    ]
    if torch.cuda.is_available():
        lines.append(f"NVIDIA driver: {driver_version()}")
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(
                f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {major}.{minor}"
            )
    else:
        lines.append("GPU: none visible to torch")
    for name, check in (
        ("FP8 GEMMs", fusible.fp8_available),
        ("block-scaled FP8 GEMMs", fusible.fp8_block_scaling_available),
    ):
        ok, why = check()
        lines.append(f"{name}: {'available' if ok else 'not available: ' + why}")
    return lines


if __name__ == "__main__":
    print("\n".join(report()))

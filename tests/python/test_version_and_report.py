"""fusible's version comes from one place (python_bindings/fusible/_version.py: the package, the
wheel's metadata and the C++ build all carry it), and `python -m fusible` reports the
environment."""

import importlib.metadata
import pathlib
import subprocess
import sys

import fusible
import pytest
import torch
from fusible import _C

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_package_the_cpp_build_and_the_metadata_carry_one_version():
    assert fusible.__version__ == _C.version
    assert fusible.__version__.count(".") == 2
    try:
        installed = importlib.metadata.version("fusible")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fusible runs from a build folder here, not an installed wheel")
    assert installed == fusible.__version__


def test_no_other_file_writes_the_version():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "\nversion =" not in pyproject
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert "python_bindings/fusible/_version.py" in cmake
    assert "project(fusible VERSION ${FUSIBLE_VERSION}" in cmake


def test_python_m_fusible_reports_the_environment():
    run = subprocess.run(
        [sys.executable, "-m", "fusible"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert f"fusible: {fusible.__version__} (C++ library {_C.version})" in out
    assert f"torch: {torch.__version__}" in out
    assert "FP8 GEMMs: " in out
    if torch.cuda.is_available():
        assert torch.cuda.get_device_name(0) in out and "compute capability" in out
        assert "NVIDIA driver: " in out
    else:
        assert "GPU: none visible to torch" in out
        assert "not available: FP8 needs a CUDA GPU" in out
    built = f"yes, for {_C.cuda_archs}" if fusible.cuda_built else "no"
    assert f"CUDA kernels built: {built}" in out

"""The C++ package of the installed wheel (fusible.cmake_prefix_path), used by a CMake project of
its own (tests/cmake_consumer): find_package(fusible 0.x) finds it and checks the version, and a
program linked against fusible::fusible builds and trains. Skipped where fusible is imported from
a build tree (no installed package there), e.g. under the sanitizer build."""

import os
import shutil
import subprocess
import sys

import fusible
import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONSUMER = os.path.join(ROOT, "tests", "cmake_consumer")
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(fusible.cmake_prefix_path, "fusible", "fusibleConfig.cmake")),
    reason="fusible is imported from a build tree here: no installed CMake package",
)


def _tool(name):
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def _configure(build_dir, version):
    prefix = f"{fusible.cmake_prefix_path};{torch.utils.cmake_prefix_path}"
    cmd = [_tool("cmake"), "-S", CONSUMER, "-B", str(build_dir), "-G", "Ninja"]
    cmd += [f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}", f"-DCMAKE_PREFIX_PATH={prefix}"]
    cmd += [f"-DFUSIBLE_WANT_VERSION={version}", "-DCMAKE_BUILD_TYPE=Release"]
    cmd += [f"-DTRAIN_MLP_SOURCE={os.path.join(ROOT, 'examples', 'cpp', 'train_mlp.cpp')}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_find_package_by_version_builds_a_program_that_trains(tmp_path):
    major_minor = ".".join(fusible.__version__.split(".")[:2])
    done = _configure(tmp_path, major_minor)
    assert done.returncode == 0, done.stdout + done.stderr
    built = subprocess.run(
        [_tool("cmake"), "--build", str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert built.returncode == 0, built.stdout + built.stderr
    ran = subprocess.run(
        [str(tmp_path / "train_mlp"), "60"], capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "loss" in ran.stdout


def test_find_package_refuses_another_minor_version(tmp_path):
    major, minor = (int(v) for v in fusible.__version__.split(".")[:2])
    done = _configure(tmp_path, f"{major}.{minor + 1}")
    assert done.returncode != 0
    assert "fusible" in done.stderr and "version" in done.stderr.lower(), done.stderr

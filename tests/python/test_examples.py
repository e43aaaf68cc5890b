"""The Python example trains (the loss falls) as a smoke test."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_mlp_example_loss_falls():
    script = os.path.join(ROOT, "examples", "python", "train_mlp.py")
    r = subprocess.run(
        [sys.executable, script, "--steps", "40", "--tokens", "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss" in r.stdout

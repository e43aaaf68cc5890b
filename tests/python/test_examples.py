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


# Runs an example's main() with --help after making argparse report every option without a
# description (a description-less option would print a bare flag in --help).
_HELP_CHECK = """
import argparse, runpy, sys
missing = []
parse = argparse.ArgumentParser.parse_args
def checked(self, *a, **k):
    if not self.description:
        missing.append("(no description)")
    missing.extend(
        a.option_strings[0] for a in self._actions if a.help is None and a.option_strings
    )
    if missing:
        sys.exit("options without a description: " + ", ".join(missing))
    return parse(self, *a, **k)
argparse.ArgumentParser.parse_args = checked
sys.argv = [sys.argv[1], "--help"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_every_python_example_option_has_a_description():
    folder = os.path.join(ROOT, "examples", "python")
    scripts = [f for f in sorted(os.listdir(folder)) if f.endswith(".py")]
    with_cli = [f for f in scripts if "argparse" in open(os.path.join(folder, f)).read()]
    assert "train_mlp.py" in with_cli and "train_gpt.py" in with_cli
    for name in with_cli:
        r = subprocess.run(
            [sys.executable, "-c", _HELP_CHECK, os.path.join(folder, name)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=folder,
        )
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
        assert "usage:" in r.stdout and "--" in r.stdout, name

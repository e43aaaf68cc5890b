"""The GPT example (examples/python): its data pipeline, that the tiny model trains, resumes
bit-exactly and computes what the same model on torch.nn modules computes, and that the model
code uses only te.ops names and keywords."""

import ast
import pathlib
import sys

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"
sys.path.insert(0, str(EXAMPLES))
gpt_data = pytest.importorskip("gpt_data")
pytest.importorskip("tokenizers")
import gpt  # noqa: E402
import torch_ops  # noqa: E402
import train_gpt  # noqa: E402
from fusible import ops  # noqa: E402

# The te.ops names (transformer_engine.pytorch.ops) the model may use, and the keywords of theirs
# it may pass: swapping the op library for te.ops must run it unchanged.
TE_OPS = {
    "Sequential": set(),
    "Linear": {"bias", "device", "dtype"},
    "LayerNorm": {"eps", "device", "dtype"},
    "RMSNorm": {"eps", "device", "dtype"},
    "GELU": set(),
    "SwiGLU": set(),
    "AddExtraInput": set(),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Token files of 40 standard-library files with the tiny model's vocabulary."""
    path = tmp_path_factory.mktemp("gpt_data")
    gpt_data.prepare(path, gpt.CONFIGS["tiny"].vocab_size, max_files=40)
    return path


def _args(data_dir, out, *extra):
    argv = ["--config", "tiny", "--device", "cpu", "--steps", "12", "--eval-every", "6"]
    argv += ["--eval-batches", "2", "--batch-size", "4", "--no-progress", "--seed", "7"]
    return train_gpt.defaults(
        train_gpt.parse_args(argv + ["--data-dir", str(data_dir), "--out", str(out), *extra])
    )


def test_tokenizer_and_dataset(data_dir):
    meta = (data_dir / "meta.json").read_text()
    assert '"vocab_size": 512' in meta
    windows = gpt_data.TokenWindows(data_dir / "train.bin", 16)
    tokens, targets = windows[3]
    assert tokens.shape == targets.shape == (16,) and tokens.dtype == torch.int64
    assert torch.equal(tokens[1:], targets[:-1])  # targets are the next tokens
    assert int(tokens.max()) < 512
    # Batches depend on (seed, step) only: a loader started at step 5 sees an uninterrupted one's.
    full = list(gpt_data.loader(data_dir, "train", 16, 3, seed=1, steps=8))
    tail = list(gpt_data.loader(data_dir, "train", 16, 3, seed=1, start_step=5, steps=3))
    for (a, _), (b, _) in zip(full[5:], tail):
        assert torch.equal(a, b)
    assert not torch.equal(full[0][0], full[1][0])
    val = gpt_data.TokenWindows(data_dir / "val.bin", 16)
    assert len(val) > 0


def test_tiny_model_trains(data_dir, tmp_path):
    _, history = train_gpt.train(_args(data_dir, tmp_path))
    losses = [loss for _, loss in history["train"]]
    assert losses[-1] < losses[0] - 0.3, losses
    assert len(history["eval"]) == 2 and history["eval"][1][1] < history["eval"][0][1]
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "checkpoint.pt").exists()


def test_resume_is_bit_exact(data_dir, tmp_path):
    """12 steps in one go, or 5 steps, a checkpoint, and the other 7 after loading it."""
    whole, _ = train_gpt.train(_args(data_dir, tmp_path / "whole", "--fp8", "delayed"))
    train_gpt.train(_args(data_dir, tmp_path / "split", "--fp8", "delayed", "--stop-at", "5"))
    resumed, _ = train_gpt.train(
        _args(data_dir, tmp_path / "split", "--fp8", "delayed", "--resume")
    )
    a, b = whole.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_fusible_model_computes_as_the_torch_nn_one(data_dir, tmp_path, style):
    """Same seed, same data, fp32 on CPU: the losses of 3 optimizer steps agree."""
    runs = {}
    for impl in ("fusible", "eager"):
        extra = ("--impl", impl, "--style", style, "--steps", "3", "--eval-every", "100")
        _, history = train_gpt.train(_args(data_dir, tmp_path / impl, *extra))
        runs[impl] = [loss for _, loss in history["train"]]
    torch.testing.assert_close(runs["fusible"], runs["eager"], rtol=1e-5, atol=1e-5)


def test_model_uses_only_te_ops_names_and_keywords():
    tree = ast.parse((EXAMPLES / "gpt.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("fusible" in (name or "") for name in imported), imported
    used = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "ops":
                used.setdefault(node.attr, set())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if isinstance(f.value, ast.Name) and f.value.id == "ops":
                used.setdefault(f.attr, set()).update(k.arg for k in node.keywords if k.arg)
    assert {"Sequential", "Linear", "AddExtraInput"} <= used.keys()
    for name, keywords in used.items():
        if name in ("RMSNorm", "LayerNorm"):
            continue  # called through `norm`, checked below
        assert name in TE_OPS, name
        assert keywords <= TE_OPS[name] | {None}, (name, keywords)
    # Every name exists in both op libraries the example runs on.
    for name in TE_OPS:
        assert hasattr(ops, name) and hasattr(torch_ops, name), name


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_randomized_models_agree_after_optimizer_steps(data_dir, style):
    """Every parameter randomized (norm scales and biases too, which the initialization sets to 1
    and 0) and copied into both models; after 3 SGD-with-momentum steps on the same batches, fp32 on
    CPU, the losses and every parameter of the fusible model equal the torch.nn model's. (Not Adam:
    it scales a gradient that is zero up to rounding, such as the key bias's, to a full step, so
    rounding alone would move the two models apart.)"""
    import dataclasses

    config = dataclasses.replace(gpt.CONFIGS["tiny"], style=style)
    models = {impl: train_gpt.build_model(config, impl, "cpu") for impl in ("fusible", "eager")}
    torch.manual_seed(3)
    with torch.no_grad():
        for p in models["eager"].parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    models["fusible"].load_state_dict(models["eager"].state_dict())
    batches = list(gpt_data.loader(data_dir, "train", config.seq_len, 4, seed=5, steps=3))
    losses = {}
    for impl, model in models.items():
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        losses[impl] = []
        for tokens, targets in batches:
            loss = model.loss(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[impl].append(loss.item())
    torch.testing.assert_close(losses["fusible"], losses["eager"], rtol=1e-5, atol=1e-5)
    assert losses["eager"][-1] != losses["eager"][0]  # the steps moved the model
    eager = models["eager"].state_dict()
    for key, value in models["fusible"].state_dict().items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, eager[key], rtol=1e-4, atol=1e-6, msg=key)

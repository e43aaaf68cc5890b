"""The documentation's examples run, and the repository paths it names exist.

Every ```python block of README.md and docs/*.md runs: one test per file, the file's blocks in
order in one shared namespace (a block may use what an earlier block of the same file defined),
with a temporary directory as the working directory. A block whose first line is
`# requires: cuda` is skipped, alone, when CUDA is not available: the blocks after it still run,
so a CUDA block must not define anything that a later CPU block uses. Blocks in other languages
(bash, console, text, cpp, cmake, ...) are not run. A block that raises fails the test with the
file and the block's line number.
"""

import os
import re
import sys
import traceback
import types

import pytest
import torch
from fusible import ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\{?[\w+-]*\}?)?\s*(.*)$")
_CUDA_MARK = "# requires: cuda"
# Prefixes of repository paths that the docs may name.
_PATH_PREFIXES = (
    "examples",
    "bench",
    "scripts",
    "csrc",
    "tests",
    "python_bindings",
    "docs",
    "cmake",
)
_PATH = re.compile(r"""(?:^|(?<=[\s"'(=]))((?:%s)/[^\s"'`(),;]*)""" % "|".join(_PATH_PREFIXES))


def _doc_files():
    """README.md and docs/*.md, relative to the repository root."""
    files = ["README.md"]
    if os.path.isdir(DOCS):
        files += [f"docs/{f}" for f in sorted(os.listdir(DOCS)) if f.endswith(".md")]
    return files


def fenced_blocks(text):
    """[(language, first line number of the code, code)] of every fenced block of a Markdown text.
    MyST's ```{code-block} python form counts as python."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, rest = m.group(1), m.group(2), (m.group(3) or ""), m.group(4)
        if lang in ("{code-block}", "{code}", "{sourcecode}"):
            lang = rest.split()[0] if rest.split() else ""
        start, body = i + 2, []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and not stripped.strip(fence[0]):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        i += 1  # past the closing fence
        blocks.append((lang.lower(), start, "\n".join(body) + "\n"))
    return blocks


def python_blocks(path):
    """[(line number, code)] of the ```python blocks of a file (path relative to the root)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return [(n, code) for lang, n, code in fenced_blocks(text) if lang in ("python", "py")]


def _needs_cuda(code):
    first = next((line.strip() for line in code.splitlines() if line.strip()), "")
    return first == _CUDA_MARK


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A temporary working directory, and the process-wide state an example may change put back
    after it: the fusion registry, torch's default dtype and device, grad mode, the CPU random
    state, Dynamo's caches and a torch.distributed default group the example started."""
    monkeypatch.chdir(tmp_path)
    fusions = ops.snapshot_fusions()
    dtype, grad = torch.get_default_dtype(), torch.is_grad_enabled()
    device, rng = torch.get_default_device(), torch.get_rng_state()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    yield
    ops.restore_fusions(fusions)
    torch.set_default_dtype(dtype)
    if torch.get_default_device() != device:
        torch.set_default_device(None if device.type == "cpu" else device)
    torch.set_grad_enabled(grad)
    torch.set_rng_state(rng)
    torch._dynamo.reset()
    if not distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("path", [f for f in _doc_files() if python_blocks(f)])
def test_python_blocks_run(path, isolated):
    # The namespace is a registered module's, so that classes an example defines can be pickled.
    module = types.ModuleType("docs_example_" + re.sub(r"\W", "_", path))
    sys.modules[module.__name__] = module
    try:
        _run_blocks(path, python_blocks(path), vars(module))
    finally:
        del sys.modules[module.__name__]


def _run_blocks(path, blocks, namespace):
    skipped = []
    for line, code in blocks:
        if _needs_cuda(code) and not torch.cuda.is_available():
            skipped.append(line)
            continue
        # Padded so that tracebacks give the line numbers of the Markdown file.
        compiled = compile("\n" * (line - 1) + code, os.path.join(ROOT, path), "exec")
        error = None
        try:
            exec(compiled, namespace)
        except Exception:
            error = traceback.format_exc()
        if error is not None:
            pytest.fail(f"{path}: the python block at line {line} raised:\n{error}", pytrace=False)
    if skipped:
        # Visible in pytest -rs, while the CPU blocks have run and passed.
        pytest.skip(f"{path}: CPU blocks pass; CUDA blocks at lines {skipped} skipped (no CUDA)")


def _inline_code(text):
    """The inline code spans of a Markdown text (outside fenced blocks)."""
    spans, in_fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            fence = m.group(2)
            if in_fence is None:
                in_fence = fence
            elif line.strip().startswith(in_fence) and not line.strip().strip(in_fence[0]):
                in_fence = None
            continue
        if in_fence is None:
            spans += re.findall(r"(`+)(.+?)\1", line)
    return [code for _, code in spans]


def referenced_paths(text):
    """The repository paths that a Markdown text names in inline code and code blocks, without
    placeholders (`<family>`, `*`, `{...}`, `...`)."""
    chunks = _inline_code(text) + [code for _, _, code in fenced_blocks(text)]
    paths = set()
    for chunk in chunks:
        for token in _PATH.findall(chunk):
            token = token.rstrip(".:")
            if any(c in token for c in "<>*{}[]$") or "..." in token:
                continue
            paths.add(token)
    return sorted(paths)


def test_referenced_paths_exist():
    """Everything the docs refer to exists: each path under examples/, bench/, scripts/, csrc/,
    tests/, python_bindings/, docs/ or cmake/ that README, CHANGELOG or a docs page names, and no
    specification file outside the repository (API.md, DESIGN.md, PERF.md) is named."""
    missing = []
    for path in _doc_files() + ["CHANGELOG.md"]:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        missing += [
            f"{path}: {p}"
            for p in referenced_paths(text)
            if not os.path.exists(os.path.join(ROOT, p))
        ]
        missing += [f"{path}: {m}" for m in re.findall(r"\b(?:API|DESIGN|PERF|STYLE)\.md\b", text)]
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_what_they_should():
    text = (
        "Run `bash scripts/nope.sh` or `examples/cpp/<name>.cpp`, see `csrc/ops/`.\n"
        "```python\n# requires: cuda\nx = 1\n```\n\n"
        "~~~bash\npython bench/missing.py --x\n~~~\n"
    )
    assert referenced_paths(text) == ["bench/missing.py", "csrc/ops/", "scripts/nope.sh"]
    blocks = fenced_blocks(text)
    assert [(lang, n) for lang, n, _ in blocks] == [("python", 3), ("bash", 8)]
    assert _needs_cuda(blocks[0][2])

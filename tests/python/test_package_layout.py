"""The Python package's layout rules: no import inside a function, no import circle between its
modules, and the import paths users write (te.ops' module names and fusible 0.1's) all resolve."""

import ast
import importlib
import pathlib
import pickle

import fusible
import pytest
from fusible import ops

ROOT = pathlib.Path(fusible.__file__).parent


def _modules():
    """{dotted name: parsed tree} of every module of the package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (ast.parse(path.read_text()), path.name == "__init__.py")
    return out


def _resolve(module, is_package, node):
    """The package modules an ImportFrom / Import node names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[: len(base) - node.level + 1]
    else:
        base = []
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] + [f"{target}.{a.name}" for a in node.names]


def _graph():
    modules = _modules()
    graph = {}
    for name, (tree, is_package) in modules.items():
        deps = set()
        for node in tree.body:  # module level only
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(d for d in _resolve(name, is_package, node) if d in modules)
        graph[name] = deps - {name}
    return graph


def test_no_import_inside_a_function():
    found = []
    for name, (tree, _) in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        found.append(f"{name}:{node.lineno}")
    assert not found, found


def test_no_import_circle():
    graph = _graph()

    # A package importing its own submodules is not a circle; a submodule importing a sibling
    # through the package (`from .. import _C`) is not one either when the package imports it
    # last. Only module-to-module edges between non-packages, plus packages' edges to non-parents.
    def edges(name):
        return {d for d in graph[name] if not name.startswith(d + ".")}

    state = {}

    def visit(name, path):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join(path + [name])
        state[name] = "open"
        for dep in sorted(edges(name)):
            visit(dep, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])
    assert "fusible.ops.op" in graph and "fusible.ops.basic.bias" in graph


@pytest.mark.parametrize(
    "path, name",
    [
        ("fusible.ops", "Linear"),
        ("fusible.ops.basic", "BasicLinear"),
        ("fusible.ops.basic.bias", "Bias"),
        ("fusible.ops.basic.basic_linear", "BasicLinear"),
        ("fusible.ops.basic.activations", "SwiGLU"),
        ("fusible.ops.fused", "ForwardLinearBiasActivation"),
        ("fusible.ops.linear", "Linear"),
        ("fusible.ops.op", "BasicOperation"),
        ("fusible.ops.op", "OperationContext"),
        ("fusible.ops.fuser", "OperationFuser"),
        ("fusible.ops.fuser", "register_forward_fusion"),
        ("fusible.ops.sequential", "Sequential"),
        # fusible 0.1's module paths, which its pickles name.
        ("fusible.ops._basic", "Bias"),
        ("fusible.ops._base", "BasicOperation"),
        ("fusible.ops._collectives", "AllReduce"),
        ("fusible.ops._containers", "Sequential"),
    ],
)
def test_import_paths_resolve_to_one_class(path, name):
    home = ops.fused if name.startswith("Forward") else ops
    assert getattr(importlib.import_module(path), name) is getattr(home, name)


def test_a_pickle_naming_an_old_module_loads():
    # What fusible 0.1 wrote for a Bias: the class by its old module path.
    bias = ops.Bias(3, device="cpu")
    ops.Bias.__module__ = "fusible.ops._basic"
    try:
        blob = pickle.dumps(bias)
    finally:
        ops.Bias.__module__ = "fusible.ops.basic.bias"
    assert b"fusible.ops._basic" in blob
    loaded = pickle.loads(blob)
    assert type(loaded) is ops.Bias and loaded.bias.shape == (3,)


def test_every_public_name_is_listed_once():
    assert len(ops.__all__) == len(set(ops.__all__))
    for name in ops.__all__:
        assert hasattr(ops, name), name

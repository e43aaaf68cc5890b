"""Every public name has a docstring, a public function's or class's docstring names each of its
parameters, and the API reference (docs/api.md) documents every public name exactly once.

Public names: `fusible.__all__`, the classes and functions of `fusible.ops.__all__` and of
`fusible.ops.fused.__all__`, the public classes defined in `fusible.recipe`, and
`fusible.functional.__all__`. A class's parameters are its `__init__`'s, looked up in the class
docstring and the `__init__` docstring together; `self`, `*args`, `**kwargs` and private
(`_name`) parameters are not checked. Where no signature can be read (pybind11 classes and
functions), only the docstring's presence is checked.
"""

import inspect
import os
import re
import types

import fusible
import pytest
from fusible import functional, ops, recipe
from fusible.ops import fused

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _members(module, names, prefix):
    return [(f"{prefix}.{name}", getattr(module, name)) for name in names]


def public_objects():
    """(qualified name, object) of every public class, function and module checked here."""
    out = _members(fusible, fusible.__all__, "fusible")
    out += _members(ops, ops.__all__, "fusible.ops")
    out += _members(fused, fused.__all__, "fusible.ops.fused")
    out += [
        (f"fusible.recipe.{name}", obj)
        for name, obj in vars(recipe).items()
        if not name.startswith("_") and inspect.isclass(obj) and obj.__module__ == recipe.__name__
    ]
    out += _members(functional, functional.__all__, "fusible.functional")
    kinds = (type, types.FunctionType, types.ModuleType)
    return [(n, o) for n, o in out if isinstance(o, kinds) or inspect.isroutine(o)]


def _own_doc(obj):
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return doc or ""


def checked_parameters(obj):
    """The parameter names the docstring must mention, or None when no signature is readable."""
    if inspect.ismodule(obj):
        return []
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    skipped = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in signature.parameters.values()
        if p.name != "self" and p.kind not in skipped and not p.name.startswith("_")
    ]


def documentation(obj):
    """The docstring text that counts for obj: a class's own and its __init__'s."""
    doc = _own_doc(obj)
    if inspect.isclass(obj) and "__init__" in vars(obj):
        doc += "\n" + (obj.__init__.__doc__ or "")
    return doc


PUBLIC = public_objects()


def test_the_public_names_are_found():
    names = {n for n, _ in PUBLIC}
    for name in (
        "fusible.autocast",
        "fusible.ops.Sequential",
        "fusible.ops.Linear",
        "fusible.ops.OperationContext",
        "fusible.ops.register_forward_fusion",
        "fusible.ops.fused.ForwardLinearBiasActivation",
        "fusible.recipe.DelayedScaling",
        "fusible.functional.cross_entropy",
    ):
        assert name in names


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_name_is_documented(name, obj):
    assert _own_doc(obj).strip(), f"{name} has no docstring"
    params = checked_parameters(obj)
    if params is None:  # pybind11: the docstring's presence is all we can check
        return
    doc = documentation(obj)
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    assert not missing, f"{name}: its docstring does not mention parameters {missing}"


_DIRECTIVE = re.compile(
    r"^\.\. (automodule|py:module|py:currentmodule|autoclass|autofunction|autodata|py:class"
    r"|py:function|py:data):: (\S+)",
    re.MULTILINE,
)


def documented_names(text):
    """The objects that the top-level autodoc / py: directives of a reST-in-Markdown page document
    (members nested in a class are not counted), qualified by the latest module directive."""
    names, module = [], ""
    for directive, target in _DIRECTIVE.findall(text):
        if directive in ("automodule", "py:module", "py:currentmodule"):
            module = target
        else:
            names.append(target if "." in target else f"{module}.{target}")
    return names


def test_api_reference_lists_every_public_name_once():
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        documented = documented_names(f.read())
    public = [n for n, o in PUBLIC if not inspect.ismodule(o)]
    public += ["fusible.__version__", "fusible.cuda_built", "fusible.cmake_prefix_path"]
    missing = sorted(set(public) - set(documented))
    assert not missing, f"docs/api.md does not document {missing}"
    twice = sorted({n for n in documented if documented.count(n) > 1})
    assert not twice, f"docs/api.md documents {twice} more than once"

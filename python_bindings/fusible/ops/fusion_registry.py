"""Fusion functions from Python: f(ops, *, recipe) -> ops, registered in the C++ registry and read
when a fuser builds a plan. f sees the user's own op objects (a Linear appears as its basic ops)."""

import atexit

from .. import _C
from ..quantization import active_recipe
from . import fused
from .op import FusibleOperation

_ids = {}  # registered function -> its registry ids (a function may be registered twice)


def _to_python(cpp_op):
    """The Python op a fusion function sees: the user's own module for a basic op or a Python
    fused op; for a built-in fused op made by an earlier fusion, its fused.<Name> face over the
    user's basic ops (with `basic_ops`, as te.ops' fused ops)."""
    if isinstance(cpp_op, _C.PyFusedOperation):
        return cpp_op.python_object
    ref = getattr(cpp_op, "_py_module", None)
    module = ref() if ref is not None else None
    if module is not None:
        return module
    face = getattr(fused, cpp_op.type_name, None) if cpp_op.is_fused else None
    if face is not None:
        return face._from_plan(cpp_op, [_to_python(b) for b in cpp_op.get_basic_ops()])
    return cpp_op


def _to_cpp(op, name):
    if isinstance(op, FusibleOperation):
        return op._cpp
    if isinstance(op, _C.FusibleOperation):
        return op
    raise TypeError(
        f"fusion {name}: expected fusible operations in the returned list, got "
        f"{type(op).__name__}"
    )


def _register(f, pass_, prepend):
    if not callable(f):
        raise TypeError(f"expected a callable fusion function, got {type(f).__name__}")
    name = getattr(f, "__name__", repr(f))

    def call(cpp_ops, *, recipe):
        result = f([_to_python(o) for o in cpp_ops], recipe=active_recipe(recipe))
        if not isinstance(result, (list, tuple)):
            raise TypeError(f"fusion {name}: expected a list of ops, got {type(result).__name__}")
        # With each op its Python object: C++ keeps a Python fused op alive while a plan uses it.
        return [(_to_cpp(o, name), o) for o in result]

    _ids.setdefault(f, []).append(_C.register_fusion(call, pass_, bool(prepend), name))


def register_forward_fusion(f, prepend=False):
    """Registers fusion function `f(ops, *, recipe) -> ops`, forward only: it rewrites the
    forward plan. prepend=True runs it before the fusions already registered (else after)."""
    return _register(f, "forward", prepend)


def register_backward_fusion(f, prepend=False):
    """Registers fusion function `f(ops, *, recipe) -> ops`, backward only: it rewrites the
    backward plan. prepend=True runs it before the fusions already registered (else after)."""
    return _register(f, "backward", prepend)


def register_forward_backward_fusion(f, prepend=False):
    """Registers fusion function `f(ops, *, recipe) -> ops` as a joint fusion: joint fusions
    run before the forward-only and backward-only ones, and the ops they make appear in both
    plans. prepend=True runs it before the joint fusions already registered (else after)."""
    return _register(f, "forward_backward", prepend)


def unregister_fusion(f):
    """Removes every registration of fusion function f; returns whether it was registered."""
    ids = _ids.pop(f, [])
    return any([_C.unregister_fusion(i) for i in ids])


def snapshot_fusions():
    """The whole registry (built-in fusions included), for restore_fusions."""
    return _C.snapshot_fusions(), {f: list(v) for f, v in _ids.items()}


def restore_fusions(snapshot):
    """Puts the registry back as snapshot_fusions() saw it (snapshot: its return value)."""
    entries, ids = snapshot
    _C.restore_fusions(entries)
    _ids.clear()
    _ids.update({f: list(v) for f, v in ids.items()})


@atexit.register
def _drop_python_fusions():
    # The C++ registry outlives the interpreter: drop Python callables while Python still runs.
    for f in list(_ids):
        unregister_fusion(f)

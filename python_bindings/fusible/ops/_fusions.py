"""Fusion functions from Python: f(ops, *, recipe) -> ops, registered in the C++ registry and read
when a fuser builds a plan. f sees the user's own op objects (a Linear appears as its basic ops)."""
from .. import _C
from ._base import FusibleOperation

_ids = {}  # registered function -> registry id


def _to_python(cpp_op):
    if isinstance(cpp_op, _C.PyFusedOperation):
        return cpp_op.python_object
    ref = getattr(cpp_op, "_py_module", None)
    module = ref() if ref is not None else None
    return module if module is not None else cpp_op


def _to_cpp(op, name):
    if isinstance(op, FusibleOperation):
        return op._cpp
    if isinstance(op, _C.FusibleOperation):
        return op
    raise TypeError(f"fusion {name}: expected fusible operations in the returned list, got "
                    f"{type(op).__name__}")


def _register(f, pass_, prepend):
    if not callable(f):
        raise TypeError(f"expected a callable fusion function, got {type(f).__name__}")
    name = getattr(f, "__name__", repr(f))

    def call(cpp_ops, *, recipe):
        result = f([_to_python(o) for o in cpp_ops], recipe=recipe)
        if not isinstance(result, (list, tuple)):
            raise TypeError(f"fusion {name}: expected a list of ops, got {type(result).__name__}")
        return [_to_cpp(o, name) for o in result]

    _ids[f] = _C.register_fusion(call, pass_, bool(prepend), name)
    return f


def register_forward_fusion(f, prepend=False):
    """Registers a forward-only fusion (run on the forward plan)."""
    return _register(f, "forward", prepend)


def register_backward_fusion(f, prepend=False):
    """Registers a backward-only fusion (run on the backward plan)."""
    return _register(f, "backward", prepend)


def register_forward_backward_fusion(f, prepend=False):
    """Registers a joint fusion (runs first; its ops appear in both plans)."""
    return _register(f, "forward_backward", prepend)


def unregister_fusion(f):
    """Removes a fusion registered from Python; returns whether it was registered."""
    fid = _ids.pop(f, None)
    return fid is not None and _C.unregister_fusion(fid)


def snapshot_fusions():
    """The whole registry (built-in fusions included), for restore_fusions."""
    return _C.snapshot_fusions(), dict(_ids)


def restore_fusions(snapshot):
    entries, ids = snapshot
    _C.restore_fusions(entries)
    _ids.clear()
    _ids.update(ids)

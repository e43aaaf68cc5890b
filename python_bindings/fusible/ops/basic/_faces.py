"""Python faces of the C++ basic ops that differ only in names and keywords, made from one row
each: the constructor's signature (te.ops'), how each argument is stored, and which stored values
the C++ constructor takes. Ops with their own logic (Bias, the linears, the norms with sequence
parallelism, Quantize, the collectives) are written out in their family's module."""

import inspect

from ... import _C
from .._args import interleave_size, reject_unsupported
from ..op import BasicOperation

REQUIRED = inspect.Parameter.empty

# Arguments every face stores the same way, under te.ops' private attribute names.
_CACHE = "cache_quantized_input"
_RECOMPUTE = "activation_recompute_in_mlp"
_INTERLEAVE = "glu_interleave_size"

CACHE_DOC = (
    "cache_quantized_input (bool): the backward keeps x as E4M3 data with a current-scaling\n"
    "            scale (a byte per element, te.ops' memory saving) and computes the gradient\n"
    "            from its dequantized values, with or without an FP8 autocast; GEMM-epilogue\n"
    "            fusions then leave the op unfused (read-only after construction)."
)
RECOMPUTE_DOC = (
    "activation_recompute_in_mlp (bool): te.ops' keyword (read-only after construction).\n"
    "            fusible's fused expert MLP (GroupedMLP_GroupedGEMMGLU) always recomputes fc2's\n"
    "            input from the activation's input in the backward, and these ops never save\n"
    "            their output, so True is what runs; False computes the same values."
)
INTERLEAVE_DOC = (
    "glu_interleave_size (int or None): x's last dim holds alternating blocks of that\n"
    "            many a and b columns (te.ops' layout); None: plain [a | b] halves."
)


def arg(name, default=REQUIRED, convert=None, *, positional=False, rejected=False):
    """One constructor argument: converted and stored as attribute `name` (te.ops' private name for
    cache_quantized_input and activation_recompute_in_mlp); rejected: a te.ops keyword accepted
    at its default only (NotImplementedError otherwise), not stored."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if positional else inspect.Parameter.KEYWORD_ONLY
    return inspect.Parameter(name, kind, default=default), convert, rejected


def _read_only(attribute, doc):
    return property(lambda self: getattr(self, attribute), doc=doc)


def make_face(name, doc, args=(), *, cpp_args=(), repr_fields=None, aliases=None, module=None):
    """The face class of C++ op `_C.<name>` (the concrete class, so C++ fusions match it by type).

    args: arg(...) rows in signature order. cpp_args: the stored attributes the C++ constructor
    takes, in order; a face with glu_interleave_size passes the checked size last. aliases: te.ops'
    attribute name -> ours (read-only). repr_fields: shown by repr (default: the public stored
    arguments)."""
    cpp_cls = getattr(_C, name)
    params = [p for p, _, _ in args]
    signature = inspect.Signature([inspect.Parameter("self", 0)] + params)
    converters = {p.name: (convert, rejected) for p, convert, rejected in args}
    gated = any(p.name == _INTERLEAVE for p in params)
    cached = any(p.name == _CACHE for p in params)

    def __init__(self, *a, **kw):
        try:
            bound = signature.bind(self, *a, **kw)
        except TypeError as e:  # named as Python names a plain function's errors
            raise TypeError(f"{name}.__init__() {e}") from None
        bound.apply_defaults()
        values = dict(list(bound.arguments.items())[1:])
        reject_unsupported(
            name,
            **{
                k: (v, signature.parameters[k].default)
                for k, v in values.items()
                if converters[k][1]
            },
        )
        for key, value in values.items():
            convert, rejected = converters[key]
            if rejected:
                continue
            value = convert(value) if convert is not None else value
            private = key in (_CACHE, _RECOMPUTE)
            setattr(self, "_" + key if private else key, value)
        BasicOperation.__init__(self, self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        values = [getattr(self, a) for a in cpp_args]
        if gated:
            values.append(interleave_size(name, self.glu_interleave_size))
        cpp = cpp_cls(*values)
        if cached:
            cpp.cache_quantized_input = self._cache_quantized_input
        return cpp

    __init__.__signature__ = signature
    __init__.__qualname__, _make_cpp.__qualname__ = f"{name}.__init__", f"{name}._make_cpp"
    stored = [
        p.name for p, _, rejected in args if not rejected and p.name not in (_CACHE, _RECOMPUTE)
    ]
    attrs = {
        "__init__": __init__,
        "_make_cpp": _make_cpp,
        "__doc__": doc,
        "__module__": module,
        "__qualname__": name,
        "_repr_fields": tuple(stored if repr_fields is None else repr_fields),
    }
    if cached:
        attrs[_CACHE] = _read_only("_" + _CACHE, "te.ops' cache_quantized_input (read-only).")
    if any(p.name == _RECOMPUTE for p in params):
        attrs[_RECOMPUTE] = _read_only("_" + _RECOMPUTE, "te.ops' keyword (read-only).")
    for te_name, ours in (aliases or {}).items():
        attrs[te_name] = _read_only(ours, f"te.ops' name of {ours}.")
    return type(name, (BasicOperation,), attrs)


def as_float(value):
    return float(value)


def as_bool(value):
    return bool(value)

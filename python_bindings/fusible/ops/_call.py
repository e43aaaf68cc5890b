"""What every fuser call does around the C++ call: checks its tensors, reads the parameters it
computes with, hands te.ops' per-op keywords to the ops, runs te.ops' pre-forward hooks and splits
the outputs."""

import contextvars
import threading

import torch

from .. import _C
from . import _fp8_weights


def unpack_outputs(outputs):
    """[y] -> y; [y, *extras] -> (y, *extras), te.ops' call convention."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def check_tensors(name, input, extra_inputs):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor input, got {type(input).__name__}")
    for i, t in enumerate(extra_inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{name}: expected extra input {i} to be a tensor, got " f"{type(t).__name__}"
            )


def split_outputs(outputs, exported):
    """A C++ fuser's [y, exported...] -> ([y, public extra outputs], {name: named outputs})."""
    public, named = [outputs[0]], {}
    for tensor, (is_public, name) in zip(outputs[1:], exported):
        if is_public:
            public.append(tensor)
        if name:
            named[name] = tensor
    return public, named


def call_parameters(sources, for_call=True):
    """The tensors a fuser call computes with: each module's current attribute, so assignment,
    functional_call, parametrizations and FSDP's unsharded parameters all take effect.
    for_call=False: for a reset (FP8 weights may still wait for it)."""
    # A registered parameter straight from _parameters (nn.Module.__getattr__ is slow); anything
    # else (a parametrization's property, a plain attribute) through getattr.
    params = [
        module._parameters[name] if name in module._parameters else getattr(module, name)
        for module, name in sources
    ]
    if _fp8_weights.pending and for_call:
        _fp8_weights.check_materialized(sources)
    return params


# te.ops' per-op keyword arguments of the call in progress ({id(basic op): kwargs}); set only by a
# call that passes some, read by the Python ops' forward (_call_op_forward / _call_fuser_forward).
_OP_KWARGS = contextvars.ContextVar("fusible_op_kwargs", default=None)


def kwargs_of(op):
    kwargs = _OP_KWARGS.get()
    return kwargs.get(id(op), {}) if kwargs else {}


def _same_kwargs(a, b):
    """Whether two keyword dicts are the same: tensors by identity, other values by ==."""

    def same(x, y):
        if x is y:
            return True
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return False
        try:
            return bool(x == y)
        except (RuntimeError, TypeError, ValueError):  # containers of tensors, arrays
            return False

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def run_with_op_kwargs(basic_ops, kwargs_list, run):
    """run() with kwargs_list[i] reaching basic_ops[i]'s op_forward (te.ops' basic_op_kwargs).
    Built-in ops take only their `_buffer_keywords` (GroupedLinear's "output" and "grad_input"
    buffers, handed to the C++ op for this call); others raise TypeError, as te.ops' built-in
    op_forward does."""
    if kwargs_list is None:
        return run()
    kwargs_list = list(kwargs_list)
    if len(kwargs_list) != len(basic_ops):
        raise ValueError(
            f"basic_op_kwargs: expected one dict per basic op ({len(basic_ops)}), "
            f"got {len(kwargs_list)}"
        )
    # The keywords reach an op object, not a position: one object at two positions takes one dict.
    seen = {}
    for i, (op, kwargs) in enumerate(zip(basic_ops, kwargs_list)):
        first = seen.setdefault(id(op), (i, dict(kwargs or {})))
        if not _same_kwargs(first[1], dict(kwargs or {})):
            raise ValueError(
                f"basic_op_kwargs: {type(op).__name__} is basic op {first[0]} and {i} (one object "
                "twice) with different keywords; per-position keywords need separate op objects"
            )
    mapping, buffers = {}, []
    for op, kwargs in zip(basic_ops, kwargs_list):
        if not kwargs:
            continue
        if op._builtin:
            buffers.append((op, kwargs))
            continue
        mapping[id(op)] = dict(kwargs)
    if not mapping and not buffers:
        return run()
    token = _OP_KWARGS.set(mapping) if mapping else None
    guards = []
    try:
        for op, kwargs in buffers:  # a built-in op's buffer keywords (GroupedLinear's)
            accepted = getattr(op, "_buffer_keywords", ())
            unknown = sorted(set(kwargs) - set(accepted))
            if unknown:
                takes = f"takes only {list(accepted)}" if accepted else "built-in ops take none"
                raise TypeError(
                    f"{type(op).__name__}.op_forward() got unexpected keyword arguments "
                    f"{unknown}: {takes}"
                )
            guards.append(_C._CallBuffers(op._cpp, **kwargs))
        return run()
    finally:
        for guard in guards:
            guard.release()
        if token is not None:
            _OP_KWARGS.reset(token)


class PreForwardHooks:
    """te.ops' pre_first_fuser_forward() (once per fuser, on its first call) and
    pre_fuser_forward(requires_grad=...) (every call) for the Python basic ops of one fuser or
    Sequential that define them; built-in ops need neither (C++ materializes parameters)."""

    def __init__(self, basic_ops):
        self._ops = [op for op in basic_ops if op._defines_pre_forward()]
        self._basic = list(basic_ops) if self._ops else []
        self._wanted = {id(op) for op in self._ops}
        self._first = True
        self._first_lock = threading.RLock()

    # A lock cannot be copied or pickled (a model that has run may be): copies get their own.
    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_first_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._first_lock = threading.RLock()

    def __call__(self, input, extra_inputs):
        if not self._ops:
            return
        if self._first:
            self._run_first_calls()
        # te.ops: an op requires backward from the first one whose input or parameters need
        # gradients on.
        grad = torch.is_grad_enabled()
        needs = grad and (
            input.requires_grad or any(getattr(e, "requires_grad", False) for e in extra_inputs)
        )
        for op in self._basic:
            needs = needs or (grad and any(p.requires_grad for p in op.parameters()))
            if id(op) in self._wanted:
                op.pre_fuser_forward(requires_grad=bool(needs))

    def _run_first_calls(self):
        # Once per fuser even when its first calls come from several threads at once (the fuser
        # runs without the GIL, and a hook may let other threads in): the others wait for it.
        # If a hook raises, the flag stays set and the next call runs the hooks again.
        with self._first_lock:
            if self._first:
                for op in self._ops:
                    op.pre_first_fuser_forward()
                self._first = False

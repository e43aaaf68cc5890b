"""torch.compile(fullgraph=True) of a fusible Sequential: under Dynamo, the whole call is one op,
`fusible::sequential_call`, whose inputs are the input, the extra and channel tensors and the
call's parameters, so the graph has no break and AOTAutograd sees every tensor it differentiates.

Its backward is a second op, `fusible::sequential_call_backward`, that recomputes the call with
autograd on and differentiates it: the compiled graph holds only the call's inputs between forward
and backward (activation recomputation). A Dropout in training mode is refused there, since its
recomputed mask would differ from the forward's. Under fusible.autocast the call carries its
recipe's key (read while tracing, so Dynamo guards on it): the recomputation casts as the forward
did, and under DelayedScaling with the forward's scales (the call's last output) and without
advancing the histories a second time.

Both ops and the autograd formula that ties them are C++ (csrc/fuser/compiled_call.cpp): a compiled
call runs no Python of ours. They find the Sequential's engine by its handle through `_resolve`,
asked once per handle and again after the engine was rebuilt. Their fake kernels (used while
tracing) are here.
"""

import weakref

import torch

from .. import _C, quantization
from .._float8_tensor import Float8Tensor

_live = {}  # id(Sequential) -> weakref: what the ops' handle names


def register(seq):
    """Makes seq reachable from the ops by its handle (its id, kept as an attribute Dynamo reads
    as a constant); called at construction and on copies."""
    handle = id(seq)
    seq.__dict__["_compile_handle"] = handle
    _C._forget_sequential(handle)  # an engine kept for an earlier object with this id

    def forget(ref):  # the entry goes with its Sequential (unless the id was reused since)
        if _live.get(handle) is ref:
            del _live[handle]

    _live[handle] = weakref.ref(seq, forget)


def _sequential(handle):
    ref = _live.get(handle)
    seq = ref() if ref is not None else None
    if seq is None:
        raise RuntimeError("fusible::sequential_call: the Sequential it was compiled for is gone")
    return seq


_HOOKED = (
    "Sequential: forward hooks on ops inside a Sequential under torch.compile are not supported "
    "yet; register the hook on the Sequential itself"
)
_SEP = "\x1f"  # joins the channel names into one string argument (the schema has no str[])


def _check_runnable(seq):
    """What a compiled call cannot honour, refused with a clear error."""
    if seq._hooked:
        # A hooked op's group reads the module's own parameters after its pre-hooks, not the
        # call's: under compile that would differentiate the wrong tensors.
        raise NotImplementedError(_HOOKED)
    from ._base import FusibleOperation

    for m in seq._entries():
        if not isinstance(m, FusibleOperation) and any(True for _ in m.parameters()):
            # Its parameters are not inputs of the op: they would get no gradient.
            raise NotImplementedError(
                f"Sequential: a {type(m).__name__} with parameters between fuser groups under "
                "torch.compile is not supported yet; compile it outside the Sequential"
            )


def _resolve(handle):
    """The engine the C++ ops run for handle (after the checks)."""
    seq = _sequential(handle)
    cpp = seq._engine()
    _check_runnable(seq)
    return cpp


_C._set_sequential_resolver(_resolve)


def _run(seq, input, extras, names, named, params):
    cpp = seq._engine()
    _check_runnable(seq)
    pairs = list(zip(names.split(_SEP), named)) if named else []
    # Without FP8: a recipe changes no shape or dtype, and a delayed-scaling state must not be
    # made from fake tensors.
    prev = _C._exchange_fp8_autocast(False, None)
    try:
        outputs, _ = cpp.run(input, list(extras), pairs, params, None)  # no hooked op: checked
    finally:
        _C._exchange_fp8_autocast(*prev)
    return outputs


@torch.library.register_fake("fusible::sequential_call")
def _(handle, input, extras, names, named, params, fp8=""):
    # The C++ ops have Meta implementations: the call itself runs on the fake tensors.
    seq = _sequential(handle)
    with torch.no_grad():
        outputs = [t.clone() for t in _run(seq, input, extras, names, named, params)]
    if fp8.startswith("delayed;"):  # the forward's scales
        n = _C._delayed_scale_count(seq._engine())
        outputs.append(input.new_empty([n], dtype=torch.float32))
    return outputs


@torch.library.register_fake("fusible::sequential_call_backward")
def _(handle, input, extras, names, named, params, grad_outputs, fp8="", fp8_scales=None):
    return [torch.empty_like(t) for t in [input, *extras, *named, *params]]


@torch.compiler.assume_constant_result
def _param_paths(handle):
    """(submodule path, attribute) of each parameter the call takes, in the fuser's order: computed
    once while Dynamo traces (it calls into C++), a constant of the graph."""
    seq = _sequential(handle)
    seq._engine()
    paths = {id(m): name for name, m in seq.named_modules()}
    return tuple((paths[id(m)], n) for m, n in seq._param_sources)


def _has_training_dropout(seq):
    from . import _basic

    dropouts = (_basic.Dropout, torch.nn.modules.dropout._DropoutNd)
    return any(isinstance(m, dropouts) and m.training and m.p > 0 for m in seq.modules())


def _in_place_op(seq):
    """The first op that writes into a tensor it was given (the custom op declares no mutation,
    and its backward recomputes the call from the same tensors), or None."""
    from . import _basic

    kinds = (_basic.AddExtraInput, _basic.MakeExtraOutput)
    return next((m for m in seq.modules() if isinstance(m, kinds) and m.in_place), None)


def compiled_forward(seq, input, extra_inputs, channel_inputs, return_dict):
    """Sequential.forward while Dynamo traces: one sequential_call."""
    if return_dict:
        raise NotImplementedError(
            "Sequential: return_dict=True under torch.compile is not supported yet"
        )
    if torch.is_grad_enabled() and _has_training_dropout(seq):
        raise NotImplementedError(
            "Sequential: a training-mode Dropout under torch.compile with autograd is not "
            "supported yet (the compiled backward recomputes the call, and would draw a new mask)"
        )
    op = _in_place_op(seq)
    if op is not None:
        raise NotImplementedError(
            f"Sequential: {type(op).__name__}(in_place=True) under torch.compile is not supported "
            "yet (it writes into a tensor the compiled call was given); use in_place=False"
        )
    from ._base import FusibleOperation

    # Read while tracing, so Dynamo guards on them: a hook added later recompiles (and is refused)
    # instead of going unseen by the compiled call.
    for m in seq._modules.values():
        if isinstance(m, FusibleOperation) and (m._forward_hooks or m._forward_pre_hooks):
            raise NotImplementedError(_HOOKED)
    paths = _param_paths(seq._compile_handle)
    params = [getattr(seq.get_submodule(path), name) for path, name in paths]
    if any(isinstance(p, Float8Tensor) for p in params):
        raise NotImplementedError(
            "Sequential: FP8 weights (quantized_model_init) under torch.compile are not supported "
            "yet; build the model without quantized_model_init (fusible.autocast still runs its "
            "GEMMs in FP8) or run it uncompiled"
        )
    named = dict(channel_inputs or {})
    names = list(named.keys())
    fp8 = quantization._compiled_key  # guarded: another recipe compiles another graph
    outputs = torch.ops.fusible.sequential_call(
        seq._compile_handle,
        input,
        list(extra_inputs),
        _SEP.join(names),
        [named[n] for n in names],
        params,
        fp8,
    )
    if fp8.startswith("delayed;"):
        outputs = outputs[:-1]  # the forward's scales are for the backward only
    return outputs[0] if len(outputs) == 1 else tuple(outputs)

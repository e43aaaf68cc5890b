"""torch.compile(fullgraph=True) of a fusible Sequential: under Dynamo, the whole call is one custom
op, `fusible::sequential_call`, whose inputs are the input, the extra and channel tensors and the
call's parameters, so the graph has no break and AOTAutograd sees every tensor it differentiates.

Its backward is a second custom op, `fusible::sequential_call_backward`, that recomputes the call
with autograd on and differentiates it: the compiled graph holds only the call's inputs between
forward and backward (activation recomputation). A Dropout in training mode is refused there,
since its recomputed mask would differ from the forward's.
"""

import contextlib
import weakref

import torch

_live = {}  # id(Sequential) -> weakref: what the custom ops' handle names


def register(seq):
    """Makes seq reachable from the custom ops by its handle (its id, kept as an attribute Dynamo
    reads as a constant); called at construction and on copies."""
    handle = id(seq)
    seq.__dict__["_compile_handle"] = handle

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


_SEP = "\x1f"  # joins the channel names into one string argument (the schema has no str[])


def _run(seq, input, extras, names, named, params):
    cpp = seq._engine()
    if seq._hooked:
        # A hooked op's group reads the module's own parameters after its pre-hooks, not the
        # call's: under compile that would differentiate the wrong tensors.
        raise NotImplementedError(
            "Sequential: forward hooks on ops inside a Sequential under torch.compile are not "
            "supported yet; register the hook on the Sequential itself"
        )
    from ._base import FusibleOperation

    for m in seq._entries():
        if not isinstance(m, FusibleOperation) and any(True for _ in m.parameters()):
            # Its parameters are not inputs of the custom op: they would get no gradient.
            raise NotImplementedError(
                f"Sequential: a {type(m).__name__} with parameters between fuser groups under "
                "torch.compile is not supported yet; compile it outside the Sequential"
            )
    pairs = list(zip(names.split(_SEP), named)) if named else []
    outputs, _ = cpp.run(input, list(extras), pairs, params, None)  # no hooked ops: checked above
    return outputs


def _own(outputs, inputs):
    """Custom-op outputs may alias neither an input nor each other: copy those that do."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        key = t.untyped_storage().data_ptr()
        out.append(t.clone() if t.numel() and key in seen else t)
        if t.numel():
            seen.add(key)
    return out


@torch.library.custom_op("fusible::sequential_call", mutates_args=())
def sequential_call(
    handle: int,
    input: torch.Tensor,
    extras: list[torch.Tensor],
    names: str,
    named: list[torch.Tensor],
    params: list[torch.Tensor],
) -> list[torch.Tensor]:
    seq = _sequential(handle)
    with torch.no_grad():
        outputs = _run(seq, input, extras, names, named, params)
    return _own(outputs, [input, *extras, *named, *params])


@sequential_call.register_fake
def _(handle, input, extras, names, named, params):
    # The C++ ops have Meta implementations: the call itself runs on the fake tensors.
    with torch.no_grad():
        outputs = _run(_sequential(handle), input, extras, names, named, params)
    return [t.clone() for t in outputs]


@contextlib.contextmanager
def _autograd_on():
    """Autograd inside a custom op's kernel: the dispatcher runs kernels with the autograd keys
    excluded, so grad mode alone would record nothing (a plain module between groups)."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(
        torch._C.DispatchKey.AutogradFunctionality
    )
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


@torch.library.custom_op("fusible::sequential_call_backward", mutates_args=())
def sequential_call_backward(
    handle: int,
    input: torch.Tensor,
    extras: list[torch.Tensor],
    names: str,
    named: list[torch.Tensor],
    params: list[torch.Tensor],
    grad_outputs: list[torch.Tensor],
) -> list[torch.Tensor]:
    seq = _sequential(handle)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in [input, *extras, *named]]
    leaves += [p.detach().requires_grad_(p.is_floating_point()) for p in params]
    ne, nn_ = len(extras), len(named)
    with _autograd_on():
        outputs = _run(
            seq,
            leaves[0],
            leaves[1 : 1 + ne],
            names,
            leaves[1 + ne : 1 + ne + nn_],
            leaves[1 + ne + nn_ :],
        )
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        wanted = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )
    by_leaf = dict(zip(map(id, wanted), grads))
    out = [g if (g := by_leaf.get(id(t))) is not None else torch.zeros_like(t) for t in leaves]
    # A gradient may be an incoming one passed straight through (an add's): copy it.
    return _own(out, [input, *extras, *named, *params, *grad_outputs])


@sequential_call_backward.register_fake
def _(handle, input, extras, names, named, params, grad_outputs):
    return [torch.empty_like(t) for t in [input, *extras, *named, *params]]


def _setup_context(ctx, inputs, output):
    handle, input, extras, names, named, params = inputs
    ctx.handle, ctx.names = handle, names
    ctx.counts = (len(extras), len(named))
    ctx.out_meta = [(o.shape, o.dtype, o.device) for o in output]
    ctx.save_for_backward(input, *extras, *named, *params)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    ne, nn_ = ctx.counts
    input, extras, named = saved[0], saved[1 : 1 + ne], saved[1 + ne : 1 + ne + nn_]
    params = saved[1 + ne + nn_ :]
    grads = [
        g if g is not None else torch.zeros(s, dtype=d, device=dev)
        for g, (s, d, dev) in zip(grads, ctx.out_meta)
    ]
    g = sequential_call_backward(
        ctx.handle, input, list(extras), ctx.names, list(named), list(params), grads
    )
    return (
        None,
        g[0],
        g[1 : 1 + ne],
        None,
        g[1 + ne : 1 + ne + nn_],
        g[1 + ne + nn_ :],
    )


sequential_call.register_autograd(_backward, setup_context=_setup_context)


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
    paths = _param_paths(seq._compile_handle)
    params = [getattr(seq.get_submodule(path), name) for path, name in paths]
    named = dict(channel_inputs or {})
    names = list(named.keys())
    outputs = sequential_call(
        seq._compile_handle,
        input,
        list(extra_inputs),
        _SEP.join(names),
        [named[n] for n in names],
        params,
    )
    return outputs[0] if len(outputs) == 1 else tuple(outputs)

"""torch.compile(fullgraph=True) of a fusible Sequential: under Dynamo, the whole call is one op,
`fusible::sequential_call`, whose inputs are the input, the extra and channel tensors and the
call's parameters, so the graph has no break and AOTAutograd sees every tensor it differentiates.

Its backward is a second op, `fusible::sequential_call_backward`, that recomputes the call with
autograd on and differentiates it: the compiled graph holds only the call's inputs between forward
and backward (activation recomputation). A training-mode Dropout's recomputed mask is drawn from
the generator state the forward started from (saved as an output
of the call), so it is the forward's. Under fusible.autocast the call carries its
recipe's key (read while tracing, so Dynamo guards on it): the recomputation casts as the forward
did, and under DelayedScaling with the forward's scales (the call's last output) and without
advancing the histories a second time.

Both ops and the autograd formula that ties them are C++ (csrc/fuser/compiled_call.cpp): a compiled
call runs no Python of ours. They find the Sequential's engine by its handle through `_resolve`,
asked once per handle and again after the engine was rebuilt. Their fake kernels (used while
tracing) are here.
"""

import itertools
import math
import weakref

import torch

from .. import _C, quantization
from .._float8_tensor import Float8Tensor
from .basic.dropout import Dropout
from .basic.extra_io import AddExtraInput, MakeExtraOutput
from .op import runs_fused

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
    "Sequential: hooks on ops inside a Sequential under torch.compile are not supported yet; "
    "register the hook on the Sequential itself"
)
_SEP = "\x1f"  # joins the channel names into one string argument (the schema has no str[])


def _check_runnable(seq):
    """What a compiled call cannot honour, refused with a clear error."""
    if seq._hooked:
        # A hooked op's group reads the module's own parameters after its pre-hooks, not the
        # call's: under compile that would differentiate the wrong tensors.
        raise NotImplementedError(_HOOKED)
    for m in seq._entries():
        if not runs_fused(m) and any(True for _ in m.parameters()):
            # Its parameters are not inputs of the op: they would get no gradient.
            raise NotImplementedError(
                f"Sequential: a {type(m).__name__} with parameters between fuser groups under "
                "torch.compile is not supported yet; compile it outside the Sequential"
            )


def _resolve(handle):
    """The engine the C++ ops run for handle (after the checks)."""
    seq = _sequential(handle)
    cpp = seq._engine(global_hooks=False)
    _check_runnable(seq)
    return cpp


_C._set_sequential_resolver(_resolve)


def autocast_arg(device_type):
    """The torch.autocast dtype in effect for device_type ("" when off), as sequential_call takes
    it: read while tracing, where Dynamo guards on the autocast state (a compiled graph runs its
    autocast regions as explicit casts, so the op is told the state the eager call would see)."""
    if not torch.is_autocast_enabled(device_type):
        return ""
    return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")


def _run(seq, input, extras, names, named, params, autocast=""):
    cpp = seq._engine(global_hooks=False)
    _check_runnable(seq)
    pairs = list(zip(names.split(_SEP), named)) if named else []
    # Without FP8: a recipe changes no shape or dtype, and a delayed-scaling state must not be
    # made from fake tensors.
    prev = _C._exchange_fp8_autocast(False, None)
    dtype = getattr(torch, autocast) if autocast else None
    amp = torch.autocast(input.device.type, dtype=dtype, enabled=bool(autocast))
    try:
        with amp:
            outputs, _ = cpp.run(input, list(extras), pairs, params, None)  # no hooked op
    finally:
        _C._exchange_fp8_autocast(*prev)
    return outputs


_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _symbols(tensors):
    """The free symbols of the tensors' sizes, in a fixed order."""
    found = {}
    for t in tensors:
        for d in t.shape:
            if isinstance(d, torch.SymInt):
                for sym in sorted(d.node.expr.free_symbols, key=str):
                    found.setdefault(sym, d.node.shape_env)
    return list(found.items())


def _concrete(t, values):
    """A fake tensor like t with its symbolic sizes evaluated at `values` (symbol -> int)."""
    shape = [
        int(d.node.expr.xreplace(values)) if isinstance(d, torch.SymInt) else d for d in t.shape
    ]
    return t.new_empty(shape)


def _symbolic_outputs(run, input, extras, named, params):
    """The outputs' shapes as expressions of the inputs' symbolic sizes, without running the C++
    ops on symbolic sizes (they would read them, and specialize the graph to one size). The call
    runs at the sizes' hints and with one symbol scaled at a time: a size the ops refuse to vary
    (a feature dim a weight fixes) is specialized, as reading it would. Then all others are scaled
    together, each by its own prime: an output size that changed is the product of the symbols
    whose primes divide the ratio, times a constant (as a reshape of leading dims gives). Any
    other dependence is refused."""
    symbols = _symbols([input, *extras, *named])
    if any(sym not in env.backed_var_to_val for sym, env in symbols):
        raise NotImplementedError(
            "Sequential: an input size with no hint (data-dependent) under torch.compile / "
            "torch.export is not supported; give it a static or backed dynamic size"
        )
    hints = {sym: int(env.backed_var_to_val[sym]) for sym, env in symbols}
    nodes = {sym: env.create_symintnode(sym, hint=hints[sym]) for sym, env in symbols}

    def run_at(values):
        return run(*(_concrete_all(ts, values) for ts in (input, extras, named)), params)

    first = run_at(hints)
    dynamic = []
    for sym, env in symbols:
        try:
            run_at({**hints, sym: hints[sym] * 2})
        except Exception:  # any refusal (RuntimeError, ValueError from a shape check, ...)
            int(nodes[sym])  # a guard: this size is fixed (a change recompiles)
            continue
        dynamic.append((sym, env))
    if len(dynamic) > len(_PRIMES):
        raise NotImplementedError(
            f"Sequential: {len(dynamic)} dynamic sizes in one call; at most {len(_PRIMES)}"
        )
    scaled = dict(hints)
    for (sym, _), p in zip(dynamic, _PRIMES):
        scaled[sym] = hints[sym] * p
    second = run_at(scaled) if dynamic else first
    outputs = []
    for a, b in zip(first, second, strict=True):
        shape = []
        for va, vb in zip(a.shape, b.shape, strict=True):
            shape.append(va if va == vb else _expression(va, vb, dynamic, hints, nodes))
        outputs.append(input.new_empty(shape, dtype=a.dtype))
    return outputs


def _concrete_all(ts, values):
    return (
        _concrete(ts, values)
        if isinstance(ts, torch.Tensor)
        else [_concrete(t, values) for t in ts]
    )


def _expression(va, vb, symbols, hints, nodes):
    """The size that is va at the hints and vb with the symbols scaled, as c * product(symbols)."""
    subset, rest = [], (vb // va if va and vb % va == 0 else 0)
    for (sym, _), p in zip(symbols, _PRIMES):
        if rest and rest % p == 0:
            subset.append(sym)
            rest //= p
    base = math.prod(hints[sym] for sym in subset)
    if not subset or rest != 1 or va % base:
        raise NotImplementedError(
            "Sequential: an output size depends on the input's dynamic sizes in a way "
            "torch.compile / torch.export cannot follow here (neither constant nor a constant "
            "times a product of them); compile with dynamic=False or export with static shapes"
        )
    expr = va // base
    for sym in subset:
        expr = nodes[sym] * expr
    return expr


def _split(tensors, num_extras, num_named):
    """[input, extras..., named..., params...] -> (input, extras, named, params)."""
    named_end = 1 + num_extras + num_named
    return (
        tensors[0],
        tensors[1 : 1 + num_extras],
        tensors[1 + num_extras : named_end],
        tensors[named_end:],
    )


@torch.library.register_fake("fusible::sequential_call")
def _fake_call(
    handle, tensors, num_extras, num_named, names, fp8="", replay_rng=False, autocast="", call_id=0
):
    # The C++ ops have Meta implementations: the call itself runs on the fake tensors.
    seq = _sequential(handle)
    input, extras, named, params = _split(tensors, num_extras, num_named)

    def run(input, extras, named, params):
        with torch.no_grad():
            outputs = _run(seq, input, extras, names, named, params, autocast)
            return [t.clone() for t in outputs]

    if _symbols([input, *extras, *named]):
        outputs = _symbolic_outputs(run, input, extras, named, params)
    else:
        # Fresh fakes of the same sizes: a replay of the graph (aot_eager's) may hand tensors
        # whose sizes read as ints in Python but are symbolic in C++, where reading them raises.
        outputs = run(*(_concrete_all(ts, {}) for ts in (input, extras, named)), params)
    if fp8.startswith("delayed;"):  # the forward's scales
        n = _C._delayed_scale_count(seq._engine(global_hooks=False))
        outputs.append(input.new_empty([n], dtype=torch.float32))
    if replay_rng:  # the state of the generator the call's Dropout draws from
        outputs.append(torch.empty(rng_state_size(input.device), dtype=torch.uint8, device="cpu"))
    return outputs


def rng_state_size(device):
    """Bytes of the state of `device`'s default generator (what get_state returns)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index].get_state().numel()
    return torch.default_generator.get_state().numel()


def replay_rng(seq):
    """Whether a call's backward must draw its Dropout masks again as its forward did: a
    training-mode Dropout (read while tracing, so Dynamo guards on it) with autograd on."""
    return torch.is_grad_enabled() and has_training_dropout(seq)


@torch.library.register_fake("fusible::sequential_call_backward")
def _(
    handle,
    tensors,
    num_extras,
    num_named,
    names,
    grad_outputs,
    fp8="",
    fp8_scales=None,
    rng_state=None,
    autocast="",
    call_id=0,
):
    return [torch.empty_like(t) for t in tensors]


_call_ids = itertools.count(1)


@torch.compiler.assume_constant_result
def _call_id():
    """A number of its own for each call in a traced graph (evaluated while tracing, a constant
    of the graph): two calls of a Sequential on the same tensors may differ (Dropout, delayed
    scaling), and distinct arguments keep AOTAutograd's CSE from merging them."""
    return next(_call_ids)


@torch.compiler.assume_constant_result
def _param_paths(handle):
    """(submodule path, attribute) of each parameter the call takes, in the fuser's order: computed
    once while Dynamo traces (it calls into C++), a constant of the graph."""
    seq = _sequential(handle)
    seq._engine(global_hooks=False)
    paths = {id(m): name for name, m in seq.named_modules()}
    return tuple((paths[id(m)], n) for m, n in seq._param_sources)


def has_training_dropout(seq):
    dropouts = (Dropout, torch.nn.modules.dropout._DropoutNd)
    return any(isinstance(m, dropouts) and m.training and m.p > 0 for m in seq.modules())


def _in_place_op(seq):
    """The first op that writes into a tensor it was given (the custom op declares no mutation,
    and its backward recomputes the call from the same tensors), or None."""
    kinds = (AddExtraInput, MakeExtraOutput)
    return next((m for m in seq.modules() if isinstance(m, kinds) and m.in_place), None)


def check_traceable(seq, what):
    """What a call as one op (whose backward recomputes it) cannot honour, refused by name; `what`:
    "torch.compile" or "torch.func"."""
    op = _in_place_op(seq)
    if op is not None:
        raise NotImplementedError(
            f"Sequential: {type(op).__name__}(in_place=True) under {what} is not supported yet "
            "(it writes into a tensor the call was given); use in_place=False"
        )
    # Read while tracing, so Dynamo guards on them: a hook added later recompiles (and is refused)
    # instead of going unseen by the compiled call.
    for m in seq._modules.values():
        hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        if any(hooks) and runs_fused(m):
            raise NotImplementedError(_HOOKED.replace("torch.compile", what))


def compiled_forward(seq, input, extra_inputs, channel_inputs, return_dict):
    """Sequential.forward while Dynamo traces: one sequential_call."""
    if return_dict:
        raise NotImplementedError(
            "Sequential: return_dict=True under torch.compile is not supported yet"
        )
    check_traceable(seq, "torch.compile")
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
    rng = replay_rng(seq)
    outputs = torch.ops.fusible.sequential_call(
        seq._compile_handle,
        [input, *extra_inputs, *(named[n] for n in names), *params],
        len(extra_inputs),
        len(names),
        _SEP.join(names),
        fp8,
        rng,
        autocast_arg(input.device.type),
        _call_id() if torch.compiler.is_compiling() else 0,  # jit.trace: compares two traces
    )
    # The forward's delayed scales and generator state are for the backward only.
    outputs = outputs[: len(outputs) - fp8.startswith("delayed;") - rng]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)

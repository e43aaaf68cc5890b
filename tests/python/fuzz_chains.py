"""Differential fuzzing of fused op chains (issue 17).

A case is a random ops.Sequential over every spec of op_specs, ops written in Python and a plain
torch module, with channels between the ops (public, named, hidden, fed by the caller, fanned
out, across fuser groups), Python fusions registered for the case, a random dtype, shapes,
memory layouts, broadcast extra inputs, requires-grad flags (flipped between calls) and no-grad
calls; fusible windows are drawn as often as single ops. It runs fused, and every output and
every gradient is compared with the unfused float64 reference built from the specs' reference
functions (tolerance: _compare; derivative kinks: run_case). Everything follows from the seed
and the device (scripts/fuzz.sh wraps this):

    python -m fuzz_chains --minutes 5 [--device cuda]       # random seeds, a line per failure
    python -m fuzz_chains --seed 1234 [--device cuda] [--minimize]
"""

import argparse
import collections
import dataclasses
import faulthandler
import math
import os
import random
import sys
import time
import traceback

import torch
from conftest import tols
from fusible import ops
from op_specs import GROUPED_SPECS, SPECS, Spec, extra_shape

# ---------------------------------------------------------------------------------------------
# Ops written in Python (te.ops' protocol) and a non-fusible module, each with its reference.


def _wide(t):
    """t in float32 at least: the Python ops compute as the built-in ops do, so that section 7's
    tolerances hold for them too."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class FeatureScale(ops.BasicOperation):
    """y = x * weight, one learnable factor per feature (op_forward / op_backward)."""

    def __init__(self, features, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(features, device=device, dtype=dtype))

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return (_wide(input_) * _wide(self.weight.detach())).to(input_.dtype)

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        dy = _wide(grad_output)
        dw = (dy * _wide(x)).reshape(-1, x.shape[-1]).sum(0).to(self.weight.dtype)
        return (dy * _wide(self.weight.detach())).to(grad_output.dtype), [dw]


class RowGate(ops.BasicOperation):
    """y = x; extra output 0 = sigmoid(mean of each row): a producer written with fuser_forward /
    fuser_backward whose extra output's gradient flows back into x."""

    num_extra_outputs = 1

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        gate = torch.sigmoid(_wide(input_).mean(-1))
        basic_op_ctxs[0].save_for_backward(gate)
        return input_, [[gate.to(input_.dtype)]]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs, **unused):
        (gate,) = basic_op_ctxs[0].saved_tensors
        dgate = basic_op_grad_extra_outputs[0][0]
        if dgate is None:  # no consumer needed the gate's gradient
            return grad_output, [[]], [[]]
        dmean = _wide(dgate) * gate * (1 - gate) / grad_output.shape[-1]
        return (_wide(grad_output) + dmean.unsqueeze(-1)).to(grad_output.dtype), [[]], [[]]


class TanhRecompute(ops.BasicOperation):
    """y = tanh(x); the backward recomputes the forward under autograd."""

    def op_forward(self, ctx, input_, **unused):
        ctx.save_for_backward(input_)
        return torch.tanh(_wide(input_)).to(input_.dtype)

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = _wide(x.detach()).requires_grad_()
            (dx,) = torch.autograd.grad(torch.tanh(x), [x], _wide(grad_output))
        return dx.to(grad_output.dtype), []


class Float32Tanh(torch.nn.Module):
    """tanh in float32 (at least): a plain torch module, which a Sequential does not fuse."""

    def forward(self, x):
        return torch.tanh(_wide(x)).to(x.dtype)


PYTHON_SPECS = [
    Spec(
        "py.FeatureScale",
        lambda d, t, s, m: FeatureScale(s[-1], d, t),
        lambda x, p, e: x * p["weight"],
    ),
    Spec(
        "py.RowGate",
        lambda d, t, s, m: RowGate(),
        lambda x, p, e: (x, torch.sigmoid(x.mean(-1))),
        extra_outputs=("rows",),
    ),
    Spec("py.TanhRecompute", lambda d, t, s, m: TanhRecompute(), lambda x, p, e: torch.tanh(x)),
]

# Not fusible: splits the Sequential into fuser groups, which channels cross.
MODULE_SPECS = [
    Spec("module.Float32Tanh", lambda d, t, s, m: Float32Tanh(), lambda x, p, e: torch.tanh(x)),
]

CATALOGUE = {s.name: s for s in SPECS + GROUPED_SPECS + PYTHON_SPECS + MODULE_SPECS}

# ---------------------------------------------------------------------------------------------
# Fusions written in Python, registered for a case and removed after it.


class PairChain(ops.FusedOperation):
    """Joint fusion of two ops without extra tensors: runs each basic op's own forward and
    backward (built-in or Python) on its context."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        x = input_
        for op, ctx in zip(self.basic_ops, basic_op_ctxs):
            x = op.op_forward(
                ctx, x, prev_op_grad_output_quantizer=None, next_op_input_quantizer=None
            )
        return x, [[] for _ in self.basic_ops]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        dy, param_grads = grad_output, []
        for op, ctx in zip(reversed(self.basic_ops), reversed(basic_op_ctxs)):
            if ctx.requires_grad:
                dy, grads = op.op_backward(ctx, dy)
            else:  # nothing before this op needs a gradient either
                dy, grads = None, [None for _ in op.parameters()]
            param_grads.insert(0, list(grads))
        return dy, param_grads, [[] for _ in self.basic_ops]


class ScaleAdd(ops.FusedOperation):
    """Joint fusion of ConstantScale + AddExtraInput: y = scale * x + extra (out of place; the
    extra tensor may be broadcast)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, **unused):
        extra = basic_op_extra_inputs[1][0]
        basic_op_ctxs[1].extra_shape = extra.shape
        return self.basic_ops[0].scale * input_ + extra, [[], []]

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        dextra = grad_output.sum_to_size(basic_op_ctxs[1].extra_shape)
        return self.basic_ops[0].scale * grad_output, [[], []], [[], [dextra]]


class ScalePair(ops.FusedOperation):
    """Forward-only ConstantScale + ConstantScale (their backwards run unfused; a forward-only
    fusion must leave their contexts as their forwards would: these keep nothing)."""

    def fuser_forward(self, basic_op_ctxs, input_, **unused):
        first, second = self.basic_ops
        return second.scale * (first.scale * input_), [[], []]


class BiasScaleBackward(ops.FusedOperation):
    """Backward-only Bias + ConstantScale: dx = scale * dy, dbias = dx summed over rows."""

    def fuser_backward(self, basic_op_ctxs, grad_output, **unused):
        dx = self.basic_ops[1].scale * grad_output
        return dx, [[dx.reshape(-1, dx.shape[-1]).sum(0)], []], [[], []]


def _is_plain(op):
    """A basic op without extra tensors (what PairChain can run)."""
    return (
        isinstance(op, ops.BasicOperation)
        and op.num_extra_inputs == 0
        and op.num_extra_outputs == 0
    )


def _pair_fusion(cls, first, second):
    """A fusion function replacing each (first, second) pair of consecutive ops by cls(pair)."""

    def fusion(ops_list, *, recipe):
        out, i = [], 0
        while i < len(ops_list):
            pair = ops_list[i : i + 2]
            if len(pair) == 2 and first(pair[0]) and second(pair[1]):
                out.append(cls(pair))
                i += 2
            else:
                out.append(ops_list[i])
                i += 1
        return out

    fusion.__name__ = f"fuse_{cls.__name__}"
    return fusion


def _isa(cls):
    return lambda op: isinstance(op, cls)


# name -> (registration function, fusion function)
PYTHON_FUSIONS = {
    "PairChain": (
        ops.register_forward_backward_fusion,
        _pair_fusion(PairChain, _is_plain, _is_plain),
    ),
    "ScaleAdd": (
        ops.register_forward_backward_fusion,
        _pair_fusion(ScaleAdd, _isa(ops.ConstantScale), _isa(ops.AddExtraInput)),
    ),
    "ScalePair": (
        ops.register_forward_fusion,
        _pair_fusion(ScalePair, _isa(ops.ConstantScale), _isa(ops.ConstantScale)),
    ),
    "BiasScaleBackward": (
        ops.register_backward_fusion,
        _pair_fusion(BiasScaleBackward, _isa(ops.Bias), _isa(ops.ConstantScale)),
    ),
}

KNOWN_FUSIONS = set(ops.fused.__all__) | set(PYTHON_FUSIONS)

# ---------------------------------------------------------------------------------------------
# Cases: generated from the seed alone.

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
DTYPE_WEIGHTS = [4, 2, 4, 1]
WIDTHS = (8, 16, 24, 32)
MIN_WIDTH = 4

# Windows the built-in and Python fusions take, drawn as often as single ops so that fusible
# windows are common. "Name:option" sets a spec option; "Linear:back" maps back to the width the
# window started with (residual blocks).
WINDOWS = [
    "Linear GELU",
    "Linear ReLU",
    "BasicLinear Bias GELU",
    "Linear",
    "Linear AddExtraInput:in_place",
    "Linear AddExtraInput",
    "BasicLinear AddExtraInput:in_place",
    "BasicLinear ConstantScale AddExtraInput:in_place",
    "BasicLinear ConstantScale",
    "MakeExtraOutput:in_place BasicLinear",
    "Bias GELU",
    "Bias ReLU",
    "Bias GELU BasicLinear",
    "Bias ReLU Linear",
    "MakeExtraOutput RMSNorm",
    "MakeExtraOutput LayerNorm",
    "GroupedLinear ScaledSwiGLU GroupedLinear",
    "MakeExtraOutput RMSNorm Linear GELU Linear:back AddExtraInput",
    "MakeExtraOutput:in_place LayerNorm Linear:back AddExtraInput:in_place",
    "ConstantScale AddExtraInput",
    "ConstantScale ConstantScale",
    "Bias ConstantScale",
    "Linear ConstantScale",
    "py.FeatureScale py.TanhRecompute",
    "py.RowGate ScaledSwiGLU",
    "py.RowGate LayerNorm ScaledSReLU",
    # Channels across fuser groups (the plain module splits them).
    "MakeExtraOutput Linear:back module.Float32Tanh AddExtraInput",
    "py.RowGate module.Float32Tanh ScaledSReLU",
]


@dataclasses.dataclass
class Step:
    """One op of a chain: its spec, input shape, constructor choices, frozen parameters and the
    routing of its extra tensors."""

    uid: int  # its position when generated (names its extra-input slots)
    spec: Spec
    shape: tuple
    out_features: int
    options: dict
    frozen: tuple = ()
    # Per extra-input slot: ("public", None), ("caller", name) (channel_inputs) or ("bound", name).
    inputs: list = dataclasses.field(default_factory=list)
    # Per extra-output slot: (channel name or None, returned to the caller).
    outputs: list = dataclasses.field(default_factory=list)

    @property
    def out_shape(self):
        return self.spec.out_shape(self.shape, self.out_features)


@dataclasses.dataclass
class Case:
    """Everything about one fuzz case but its values, which come from the seed when it runs."""

    seed: int
    device: str
    dtype: torch.dtype
    x_shape: tuple
    x_grad: bool
    steps: list
    grad_inputs: dict  # float extra input (its slot's name or channel name) -> requires_grad
    calls: tuple  # each "grad" or "no_grad"
    flips: tuple  # "x" and (op uid, parameter name): requires_grad flipped after the first call
    fusions: list  # (Python fusion name, prepend)
    return_dict: bool
    layout: str  # of x and the float extra inputs (see _with_layout)
    dy_layout: str  # of the output gradients
    broadcast: dict  # float extra input (slot or channel name) -> its smaller, broadcast shape
    index_dtype: torch.dtype  # of split sizes
    minimized: bool = False  # a smaller variant of the seed's case (minimize), not the case itself

    @property
    def gemm(self):
        return any(step.spec.gemm for step in self.steps)


def make_case(seed, device="cpu"):
    """The case of this seed: structure, flags and (through the seed) every value."""
    rng = random.Random(seed)
    dtype = rng.choices(DTYPES, DTYPE_WEIGHTS)[0]
    x_shape = (
        *[rng.randint(1, 5) for _ in range(rng.choice([0, 1, 1, 2, 2, 3]))],
        rng.choice(WIDTHS),
    )
    steps = _random_steps(rng, x_shape)
    for uid, step in enumerate(steps):
        step.uid = uid
    wiring = _Wiring(rng)
    wiring.route(steps)
    for step in steps:
        step.frozen = _random_frozen(rng, step)
    float_inputs = wiring.public + wiring.float_callers()
    calls = rng.choice([("grad",), ("grad",), ("no_grad",), ("no_grad", "grad"), ("grad", "grad")])
    all_named = all(name is not None for step in steps for name, shown in step.outputs if shown)
    return Case(
        seed=seed,
        device=device,
        dtype=dtype,
        x_shape=x_shape,
        x_grad=rng.random() < 0.8,
        steps=steps,
        grad_inputs={key: rng.random() < 0.6 for key in float_inputs},
        calls=calls,
        flips=_random_flips(rng, steps) if len(calls) > 1 else (),
        fusions=[(name, rng.random() < 0.3) for name in PYTHON_FUSIONS if rng.random() < 0.5],
        return_dict=all_named and rng.random() < 0.3,
        layout=rng.choice(["contiguous", "contiguous", "strided", "transposed"]),
        dy_layout=rng.choice(["contiguous", "contiguous", "strided", "expanded"]),
        broadcast=_random_broadcasts(rng, steps, float_inputs),
        index_dtype=rng.choice([torch.int64, torch.int32]),
    )


def _random_flips(rng, steps):
    """What changes its requires_grad between calls (plans depend on it): x, a parameter."""
    params = [(step.uid, name) for step in steps for name in _parameter_names(step)]
    flips = ["x"] if rng.random() < 0.3 else []
    return tuple(flips + ([rng.choice(params)] if params and rng.random() < 0.5 else []))


def _random_broadcasts(rng, steps, float_inputs):
    """Some x-shaped extra inputs from the caller come smaller, for AddExtraInput to broadcast
    (not for an in-place add, which refuses an extra tensor that cannot hold the sum)."""
    shapes = {}
    for step in steps:
        if step.options.get("in_place"):
            continue
        for slot, (kind, (how, name)) in enumerate(zip(step.spec.extras, step.inputs)):
            key = name if how == "caller" else _slot_name(step, slot)
            if kind == "x" and key in float_inputs and key not in shapes and rng.random() < 0.2:
                leading = [rng.choice([1, d]) for d in step.shape[:-1]]
                shapes[key] = (*leading[rng.randint(0, len(leading)) :], step.shape[-1])
    return shapes


def _random_steps(rng, shape):
    """1 to 5 pieces, each a fusible window (half the time) or a single op that fits."""
    steps = []
    for _ in range(rng.randint(1, 5)):
        window = rng.choice(WINDOWS) if rng.random() < 0.5 else None
        piece = _window_steps(rng, window, shape) if window else None
        if piece is None:
            fitting = [s for s in CATALOGUE.values() if _fits(s, shape)]
            piece = [_step(rng, rng.choice(fitting), shape)]
        steps += piece
        shape = piece[-1].out_shape
    return steps


def _fits(spec, shape):
    """Whether the spec takes this shape and leaves at least MIN_WIDTH features (a norm over two
    features is too ill-conditioned to compare in low precision)."""
    return spec.fits(shape) and spec.out_shape(shape, min(WIDTHS))[-1] >= MIN_WIDTH


def _window_steps(rng, window, shape):
    """The steps of a window at this input shape, or None when an op of it does not fit."""
    steps, start = [], shape
    for entry in window.split():
        name, _, flag = entry.partition(":")
        spec = CATALOGUE[name]
        if not _fits(spec, shape):
            return None
        options = {flag: True} if flag in spec.options else {}
        step = _step(rng, spec, shape, options)
        if flag == "back":
            step.out_features = start[-1]
        steps.append(step)
        shape = step.out_shape
    return steps


def _step(rng, spec, shape, options=None):
    chosen = {name: rng.choice(values) for name, values in spec.options.items()}
    chosen.update(options or {})
    return Step(-1, spec, tuple(shape), rng.choice(WIDTHS), chosen)


def _random_frozen(rng, step):
    """Names of the step's parameters that do not require grad (one in six)."""
    return tuple(name for name in _parameter_names(step) if rng.random() < 1 / 6)


def _parameter_names(step):
    op = step.spec.make("meta", torch.float32, step.shape, step.out_features, **step.options)
    return [name for name, _ in op.named_parameters()]


class _Wiring:
    """Routes every extra tensor of a chain: each extra input is public, fed by name by the
    caller or bound to an earlier producer of its shape; each extra output is public, named or
    hidden."""

    def __init__(self, rng):
        self.rng = rng
        self.producers = []  # [shape, name, consumer count, step] per extra output
        self.callers = {}  # channel name -> shape (None for split sizes), for caller-fed names
        self.public = []  # slot names of the public float extra inputs

    def route(self, steps):
        for step in steps:
            for slot, kind in enumerate(step.spec.extras):
                key = _slot_name(step, slot)
                source = self._source(kind, step.shape, key)
                step.inputs.append(source)
                if source[0] == "public" and kind != "splits":
                    self.public.append(key)
            for slot, kind in enumerate(step.spec.extra_outputs):
                name = f"c{step.uid}_{slot}"
                self.producers.append([extra_shape(kind, step.shape), name, 0, step])
        for _, name, consumers, step in self.producers:
            step.outputs.append(_output_routing(self.rng, name, consumers))

    def float_callers(self):
        return [name for name, shape in self.callers.items() if shape is not None]

    def _source(self, kind, shape, fresh_name):
        rng = self.rng
        if kind == "splits":  # integers: from the caller, by position or by name
            if rng.random() < 0.3:
                self.callers[fresh_name] = None
                return ("caller", fresh_name)
            return ("public", None)
        wanted = extra_shape(kind, shape)
        matching = [p for p in self.producers if p[0] == wanted]
        if matching and rng.random() < 0.6:
            producer = rng.choice(matching)
            producer[2] += 1
            return ("bound", producer[1])
        if rng.random() < 0.25:
            return ("caller", self._caller_name(wanted, fresh_name))
        return ("public", None)

    def _caller_name(self, shape, fresh_name):
        """A fresh name, or (half the time) one the caller already feeds: fan-out."""
        shared = [n for n, s in self.callers.items() if s == shape]
        name = self.rng.choice(shared) if shared and self.rng.random() < 0.5 else fresh_name
        self.callers[name] = shape
        return name


def _slot_name(step, slot):
    """An extra-input slot's name: its key in grad_inputs, and its channel when the caller feeds
    it by name."""
    return f"in{step.uid}_{slot}"


def _output_routing(rng, name, consumers):
    if consumers:
        return (name, rng.random() < 0.3)
    return rng.choice([(None, True), (None, True), (name, True), (name, False)])


# ---------------------------------------------------------------------------------------------
# Describing a case (failure messages and replays).


def describe(case):
    """The case in words: the seed (enough to replay it), the call, then one line per op."""
    origin = f"seed {case.seed}" + (", minimized" if case.minimized else "")
    lines = [
        f"{origin} on {case.device}: {str(case.dtype).replace('torch.', '')}, "
        f"x {list(case.x_shape)} requires_grad={case.x_grad}, calls {'+'.join(case.calls)}, "
        f"return_dict={case.return_dict}, python fusions "
        f"{[n + (' (prepended)' if p else '') for n, p in case.fusions] or 'none'}",
    ]
    lines += [f"  {i}: {_describe_step(step)}" for i, step in enumerate(case.steps)]
    needing = [k for k, v in case.grad_inputs.items() if v]
    lines.append(f"  extra inputs requiring grad: {needing or 'none'}")
    lines.append(
        f"  layout {case.layout}, output gradients {case.dy_layout}, split sizes "
        f"{str(case.index_dtype).replace('torch.', '')}, broadcast extra inputs "
        f"{case.broadcast or 'none'}, flipped after the first call: {list(case.flips) or 'none'}"
    )
    return "\n".join(lines)


def _describe_step(step):
    parts = [step.spec.name, f"{list(step.shape)} -> {list(step.out_shape)}"]
    parts += [f"{k}={v}" for k, v in step.options.items()]
    if step.frozen:
        parts.append(f"frozen {list(step.frozen)}")
    for slot, (how, name) in enumerate(step.inputs):
        parts.append(f"in{slot}: {how}" + (f" '{name}'" if name else ""))
    for slot, (name, shown) in enumerate(step.outputs):
        parts.append(
            f"out{slot}: {'shown' if shown else 'hidden'}" + (f" '{name}'" if name else "")
        )
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Running a case against the reference.


class CaseFailure(AssertionError):
    """A wrong value or gradient, or an exception: the case's description, then what failed."""

    def __init__(self, case, detail):
        super().__init__(f"{describe(case)}\n{detail}")
        self.detail = detail


@dataclasses.dataclass
class Inputs:
    """The float64 values of one call (x, public extra inputs, channel inputs), as the case's
    dtype rounds them."""

    x: torch.Tensor
    public: dict  # slot name -> tensor, in call order
    named: dict


# Marks (in run_case's result) a case that passed only with redrawn values.
REDRAWN = "values redrawn: a derivative kink"
# Marks a case with result elements the unfused chain overflows in the case's dtype (not compared).
OUT_OF_RANGE = "a result out of the dtype's range"
KINK_RETRIES = 2


def run_case(case):
    """Runs the case; returns the set of fusions its plans used. Raises CaseFailure (with the
    seed and the chain) on a wrong value or gradient, or on an exception.

    A derivative that jumps (ReLU, a clamp) may take one side in the fused run and the other in
    the reference when a value lies within rounding noise of the jump, a wrong gradient that no
    tolerance covers. So a wrong gradient in a chain with such an op is checked again with other
    values (KINK_RETRIES times): a bug shows with them too; the result then holds REDRAWN."""
    try:
        return run_values(case, case.seed)
    except CaseFailure as failure:
        if not (failure.detail.startswith("grad ") and any(s.spec.kinked for s in case.steps)):
            raise
        for retry in range(1, KINK_RETRIES + 1):
            try:
                return run_values(case, case.seed + retry) | {REDRAWN}
            except CaseFailure:
                pass
        raise


def run_values(case, data_seed):
    """run_case with the values of data_seed (the case's seed gives its own)."""
    snapshot = ops.snapshot_fusions()
    try:
        for name, prepend in case.fusions:
            register, fusion = PYTHON_FUSIONS[name]
            register(fusion, prepend=prepend)
        return _run_calls(case, data_seed)
    except CaseFailure:
        raise
    except Exception as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        raise CaseFailure(case, f"raised {detail}") from e
    finally:
        ops.restore_fusions(snapshot)


def _run_calls(case, data_seed):
    gen = torch.Generator().manual_seed(data_seed)
    seq, modules = _build(case, gen)
    fusions, x_grad = set(), case.x_grad
    for i, call in enumerate(case.calls):
        if i == 1:
            x_grad = _flip(case, modules, x_grad)
        inputs = _random_inputs(case, gen)
        with torch.set_grad_enabled(call == "grad"):
            fusions |= _check_call(case, seq, modules, inputs, x_grad, gen)
        fusions |= _plan_fusions(seq.fusion_plan(), backward=call == "grad")
    return fusions


def _flip(case, modules, x_grad):
    """Flips requires_grad of what case.flips names; returns x's new flag."""
    by_uid = {step.uid: m for step, m in zip(case.steps, modules)}
    for flip in case.flips:
        if flip != "x" and flip[0] in by_uid:  # (minimize may have dropped the op)
            p = by_uid[flip[0]].get_parameter(flip[1])
            p.requires_grad_(not p.requires_grad)
    return x_grad != ("x" in case.flips)


def _build(case, gen):
    modules = []
    for step in case.steps:
        op = step.spec.make(case.device, case.dtype, step.shape, step.out_features, **step.options)
        with torch.no_grad():
            for name, p in op.named_parameters():
                p.copy_(_random_parameter(p, gen))
                p.requires_grad_(name not in step.frozen)
        _route(op, step)
        modules.append(op)
    return ops.Sequential(*modules), modules


def _random_parameter(p, gen):
    """Never zeros; a matrix scaled by its fan-in so that chains keep values near 1."""
    scale = p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5
    return torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale + 0.1


def _route(op, step):
    for slot, (how, name) in enumerate(step.inputs):
        if how != "public":
            op.set_extra_input_channel(slot, name)
    for slot, (name, shown) in enumerate(step.outputs):
        if name is not None:
            op.set_extra_output_channel(slot, name, output_to_caller=shown)


def _random_inputs(case, gen):
    x = torch.randn(case.x_shape, generator=gen, dtype=torch.float64)
    public, named = {}, {}
    for step in case.steps:
        for slot, (kind, (how, name)) in enumerate(zip(step.spec.extras, step.inputs)):
            if how == "bound" or name in named:
                continue
            key = name if how == "caller" else _slot_name(step, slot)
            value = _random_extra(kind, step.shape, gen, case.broadcast.get(key))
            if value.is_floating_point():  # the values the dtype can hold
                value = value.to(case.dtype).double()
            if how == "public":
                public[_slot_name(step, slot)] = value
            else:
                named[name] = value
    return Inputs(x=x.to(case.dtype).double(), public=public, named=named)


def _random_extra(kind, shape, gen, broadcast_shape=None):
    if kind == "splits":
        return _random_splits(math.prod(shape[:-1]), 3, gen)
    size = broadcast_shape or extra_shape(kind, shape)
    if kind == "x":
        return torch.randn(size, generator=gen, dtype=torch.float64)
    return torch.rand(size, generator=gen, dtype=torch.float64) + 0.5  # scales, as a router's


def _random_splits(rows, groups, gen):
    """Split sizes of `rows` rows into `groups` groups (empty groups included)."""
    cuts = torch.randint(0, rows + 1, (groups - 1,), generator=gen).sort().values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])
    return bounds.diff()


def _check_call(case, seq, modules, inputs, x_grad, gen):
    """One call of seq against the reference: every output, then (in grad mode) the gradient of
    every leaf that required grad before the call (x, extra inputs, parameters) for random output
    gradients. Returns {OUT_OF_RANGE} when elements of a result were not compared, else an empty
    set."""
    leaves = _device_inputs(case, inputs, x_grad)
    # Before the call: an in-place add writes into (and re-flags) the caller's extra tensors.
    ref_leaves = _reference_leaves(inputs, leaves)
    params = _reference_parameters(modules)
    wanted, ref_wanted = _grad_leaves(leaves, modules), _grad_leaves(ref_leaves, params)
    x0 = leaves["x"].detach().clone()
    callers = [leaves["x"], *leaves["public"].values(), *leaves["named"].values()]
    callers = {t.data_ptr() for t in callers}
    outs = _call(case, seq, leaves)
    if not torch.equal(leaves["x"].detach(), x0):
        _fail(case, "the call wrote into the caller's x")
    _check_outputs_metadata(case, outs)
    if not torch.is_grad_enabled():
        if any(o.requires_grad and o.data_ptr() not in callers for o in outs):
            # (An in-place add returns the caller's own tensor, which may require grad.)
            _fail(case, "an output of a no-grad call requires grad")
        wanted = {}
    dys = _output_gradients(case, [o.shape for o in outs], gen) if wanted else None
    got = _fused_results(case, outs, wanted, dys)

    def reference(rounding):
        return _reference_results(case, ref_leaves, params, ref_wanted, dys, rounding)

    exact, noisy = reference(None), [reference(0)]
    for name, out in zip(exact, outs):
        if torch.is_grad_enabled() and exact[name].requires_grad and not out.requires_grad:
            _fail(case, f"{name} depends on a leaf that requires grad, but has no gradient")
    try:
        return _compare_results(case, got, exact, noisy)
    except CaseFailure:  # one noise sample can be small by chance: measure it once more
        noisy.append(reference(1))
        return _compare_results(case, got, exact, noisy)


def _check_outputs_metadata(case, outs):
    for i, out in enumerate(outs):
        if out.dtype != case.dtype or out.device.type != torch.device(case.device).type:
            _fail(case, f"output {i}: {out.dtype} on {out.device}, expected {case.dtype}")


def _output_gradients(case, shapes, gen):
    """Random output gradients (float64, the values the dtype holds), in the case's layout."""
    dys = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    return [_with_layout(dy.to(case.dtype), case.dy_layout).double() for dy in dys]


def _result_names(count, wanted):
    return ["y"] + [f"extra output {i}" for i in range(count - 1)] + [f"grad {n}" for n in wanted]


def _fused_results(case, outs, wanted, dys):
    """Name -> each output and each wanted gradient (zeros for a None gradient: a channel's
    absent gradient means zero) of the fused run."""
    results = list(outs)
    if dys is not None:
        device_dys = [_with_layout(dy.to(case.device, case.dtype), case.dy_layout) for dy in dys]
        grads = _grads(outs, list(wanted.values()), device_dys)
        for (name, leaf), g in zip(wanted.items(), grads):
            if g is not None and (g.dtype != leaf.dtype or g.shape != leaf.shape):
                _fail(case, f"grad {name}: {g.dtype} {list(g.shape)}, expected {leaf.dtype}")
            results.append(torch.zeros_like(leaf) if g is None else g)
    return dict(zip(_result_names(len(outs), wanted or {}), results))


def _reference_results(case, leaves, params, wanted, dys, rounding):
    """_fused_results of the float64 reference (see _reference for rounding)."""
    outs = _reference(case, leaves, params, rounding)
    results = list(outs)
    if dys is not None:
        grads = _grads(outs, list(wanted.values()), dys)
        results += [
            torch.zeros(t.shape, dtype=torch.float64) if g is None else g
            for t, g in zip(wanted.values(), grads)
        ]
    return dict(zip(_result_names(len(outs), wanted if dys is not None else {}), results))


def _compare_results(case, got, exact, noisy):
    if list(got) != list(exact):
        _fail(case, f"results {list(got)}, expected {list(exact)}")
    skipped = set()
    for name, g in got.items():
        want, samples = exact[name], [n[name].detach() for n in noisy]
        # Where the reference, or the reference rounded as the unfused chain must round, passes
        # the dtype's largest value (fp16's 65504), the dtype overflows: no tolerance judges those
        # elements (inf against a finite value); the others are still compared.
        largest = torch.finfo(case.dtype).max
        in_range = want.detach().abs() <= largest
        for sample in samples:
            in_range &= sample.abs() <= largest  # (NaN compares false)
        if g.shape == want.shape and not in_range.all():
            skipped.add(OUT_OF_RANGE)
            g, want = g.detach().cpu()[in_range], want.detach()[in_range]
            samples = [sample[in_range] for sample in samples]
        _compare(case, name, g, want, max((_noise(n, want) for n in samples), default=0.0))
    return skipped


def _noise(noisy, exact):
    return (noisy.detach() - exact.detach()).abs().max().item() if exact.numel() else 0.0


def _device_inputs(case, inputs, x_grad):
    """The call's tensors in the case's device, dtype and layout, with the case's requires-grad
    flags."""

    def leaf(key, t, grad):
        if not t.is_floating_point():  # split sizes
            return t.to(case.device, case.index_dtype)
        # A copy: in-place ops write into the caller's extra tensors.
        t = t.to(case.device, case.dtype, copy=True)
        t = _with_layout(t, case.layout)
        return t.requires_grad_(grad)

    def leaves(tensors):
        return {k: leaf(k, t, case.grad_inputs.get(k, False)) for k, t in tensors.items()}

    return {
        "x": leaf("x", inputs.x, x_grad),
        "public": leaves(inputs.public),
        "named": leaves(inputs.named),
    }


def _with_layout(t, layout):
    """The same values in another memory layout: "strided" (every other element of a wider
    tensor), "transposed" (the last two dims swapped in memory) or "expanded" (one value
    broadcast, for output gradients as sum().backward() makes them)."""
    if layout == "strided" and t.dim() >= 1:
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        return wide[..., ::2].copy_(t)
    if layout == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "expanded":
        return t.reshape(-1)[:1].reshape([1] * t.dim()).expand(t.shape)
    return t


def _call(case, seq, leaves):
    kwargs = {"channel_inputs": leaves["named"]} if leaves["named"] else {}
    # Non-leaf copies of the extra tensors that require grad: an in-place add refuses a leaf that
    # requires grad while autograd records, as torch's in-place ops do.
    public = [
        t.clone() if torch.is_grad_enabled() and t.requires_grad else t
        for t in leaves["public"].values()
    ]
    if case.return_dict:
        y, named = seq(leaves["x"], *public, return_dict=True, **kwargs)
        return [y] + [named[name] for name in _shown_names(case)]
    out = seq(leaves["x"], *public, **kwargs)
    return list(out) if isinstance(out, tuple) else [out]


def _shown_names(case):
    return [name for step in case.steps for name, shown in step.outputs if shown]


def _reference_parameters(modules):
    """Per module, its parameters as float64 CPU leaves (the values the fused run used)."""
    return [
        {
            name: p.detach().double().cpu().requires_grad_(p.requires_grad)
            for name, p in m.named_parameters()
        }
        for m in modules
    ]


def _reference_leaves(inputs, leaves):
    def leaf(t, device_leaf):
        return t.clone().requires_grad_(device_leaf.requires_grad)

    return {
        "x": leaf(inputs.x, leaves["x"]),
        "public": {k: leaf(t, leaves["public"][k]) for k, t in inputs.public.items()},
        "named": {k: leaf(t, leaves["named"][k]) for k, t in inputs.named.items()},
    }


def _reference(case, leaves, params, rounding=None):
    """The unfused chain in float64: each spec's reference, channels routed by name. With a
    rounding realization (0, 1), every op's outputs and, backward, their gradients are rounded as
    the unfused chain stores them (see _Round): the chain's own rounding noise."""
    x, public, produced, outs = leaves["x"], iter(leaves["public"].values()), {}, []
    for step, p in zip(case.steps, params):
        extras = [
            _source(how, name, public, leaves["named"], produced) for how, name in step.inputs
        ]
        fmt = _storage_format(case, step)
        if rounding is not None and fmt == "tf32":  # the GEMM's inputs, too
            x = _Round.apply(x, fmt, rounding)
            p = {k: _Round.apply(v, fmt, rounding) if v.dim() == 2 else v for k, v in p.items()}
        result = step.spec.ref(x, p, extras)
        x, *extra_outputs = result if isinstance(result, tuple) else (result,)
        if rounding is not None:
            x = _Round.apply(x, fmt, rounding)
            extra_outputs = [_Round.apply(t, fmt, rounding) for t in extra_outputs]
        for (name, shown), t in zip(step.outputs, extra_outputs):
            if name is not None:
                produced[name] = t
            if shown:
                outs.append(t)
    return [x] + outs


def _storage_format(case, step):
    """What the fused run rounds this op's results to: the dtype, or TF32 for a GEMM in float32
    on CUDA (the float64-reference tolerances in conftest.py allow it)."""
    cuda_gemm = step.spec.gemm and str(case.device).startswith("cuda")
    return "tf32" if cuda_gemm and case.dtype == torch.float32 else case.dtype


_UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    "tf32": 2.0**-11,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def _round_values(t, fmt, realization):
    """t rounded to fmt (a dtype or "tf32"), in float64. Realization 1 first moves each value by
    up to a unit roundoff (a fixed pattern), so that it rounds differently: another noise sample.
    Float64 cannot round to itself, so it always gets that move: its noise, one rounding's."""
    t = t.detach()
    if realization or fmt == torch.float64:
        pattern = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape) * (realization + 1)
        t = t * (1 + _UNIT_ROUNDOFF[fmt] * (torch.remainder(pattern, 3) - 1))
    if fmt == "tf32":  # float32 with a 10-bit mantissa: round off the low 13 bits
        bits = t.float().contiguous().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()
    return t.to(fmt).double()


class _Round(torch.autograd.Function):
    """_round_values in the forward and in the backward."""

    @staticmethod
    def forward(ctx, t, fmt, realization):
        ctx.fmt, ctx.realization = fmt, realization
        return _round_values(t, fmt, realization)

    @staticmethod
    def backward(ctx, grad):
        return _round_values(grad, ctx.fmt, ctx.realization), None, None


def _source(how, name, public, named, produced):
    if how == "public":
        return next(public)
    return named[name] if how == "caller" else produced[name]


def _grad_leaves(leaves, modules_or_params):
    """Name -> every leaf that requires grad: x, extra inputs, each module's parameters."""
    out = {"x": leaves["x"]}
    out.update({f"extra input {k}": t for k, t in leaves["public"].items()})
    out.update({f"channel input '{k}'": t for k, t in leaves["named"].items()})
    for i, m in enumerate(modules_or_params):
        items = m.items() if isinstance(m, dict) else m.named_parameters()
        out.update({f"op {i} {name}": p for name, p in items})
    return {k: t for k, t in out.items() if t.requires_grad}


def _grads(outs, leaves, dys):
    pairs = [(o, dy) for o, dy in zip(outs, dys) if o.requires_grad]
    if not pairs:
        return [None] * len(leaves)
    return torch.autograd.grad(
        [o for o, _ in pairs], leaves, [dy for _, dy in pairs], allow_unused=True
    )


# How many times the chain's own rounding noise a result may be off by (see _compare).
NOISE_FACTOR = 8


def _compare(case, what, got, want, noise):
    """Against the float64 reference rounded to the dtype, the float64-reference tolerance for
    the dtype (conftest.py's tols(); its GEMM row when the chain has a GEMM), with an absolute
    allowance for the chain's own rounding noise: NOISE_FACTOR times how far the reference moves
    when it rounds every intermediate value and gradient as the unfused chain must (noise: the
    largest such move over the tensor). One op's tolerance does not cover a chain: cancellations,
    norms and scale-invariant gradients amplify the roundings of earlier ops."""
    rtol, atol = tols(case.dtype, case.gemm, case.device)
    try:
        torch.testing.assert_close(
            got.detach().double().cpu(),
            want.detach().to(case.dtype).double(),
            rtol=rtol,
            atol=atol + NOISE_FACTOR * noise,
        )
    except AssertionError as e:
        _fail(case, f"{what}: {e}\n(rounding-noise allowance {NOISE_FACTOR} x {noise:.3g})")


def _fail(case, message):
    raise CaseFailure(case, message)


def _plan_fusions(plan, backward):
    """The fused ops (built-in or Python) that a Sequential's plan used."""
    names = set()
    for group in plan:
        names.update(group.get("forward", []))
        if backward:
            names.update(group.get("backward", []))
    return names & KNOWN_FUSIONS


# ---------------------------------------------------------------------------------------------
# Minimizing a failing case: greedy, one simplification at a time while the case still fails.


def minimize(case):
    """The smallest variant of a failing case that still fails the same way (ops dropped,
    channels made public, Python fusions and flags removed). Its values differ from the seed's
    case."""
    kind = _failure_kind(case)
    while True:
        smaller = next((c for c in _simpler_cases(case) if _failure_kind(c) == kind), None)
        if smaller is None:
            return case
        case = smaller


def _failure_kind(case):
    """None when the case passes, else what failed: the exception's type, a wrong value, a wrong
    gradient, or the message of another check."""
    try:
        run_case(case)
    except CaseFailure as e:
        first = e.detail.splitlines()[0]
        if first.startswith("raised "):
            return first.split(":")[0]
        if first.startswith(("y:", "extra output")):
            return "wrong value"
        return "wrong gradient" if first.startswith("grad ") else first
    return None


def _simpler_cases(case):
    for i in range(len(case.steps)):
        if len(case.steps) > 1 and _droppable(case, i):
            yield _without_step(case, i)
    if case.flips:
        yield _variant(case, flips=())
    for i in range(len(case.fusions)):
        yield _variant(case, fusions=case.fusions[:i] + case.fusions[i + 1 :])
    for calls in [("grad",), ("no_grad",)]:
        if calls != case.calls and set(calls) <= set(case.calls):
            yield _variant(case, calls=calls)
    if case.return_dict:
        yield _variant(case, return_dict=False)
    for i, step in enumerate(case.steps):
        if step.frozen:
            yield _variant(case, steps=_replace_step(case, i, frozen=()))
        for slot, (how, _) in enumerate(step.inputs):
            if how != "public":
                inputs = step.inputs[:slot] + [("public", None)] + step.inputs[slot + 1 :]
                yield _variant(case, steps=_replace_step(case, i, inputs=inputs))
    for key, needs in case.grad_inputs.items():
        if needs:
            yield _variant(case, grad_inputs={**case.grad_inputs, key: False})


def _droppable(case, i):
    """The first and last ops can always go; another only when it keeps the shape."""
    step = case.steps[i]
    return i in (0, len(case.steps) - 1) or step.out_shape == step.shape


def _without_step(case, i):
    gone = {name for name, _ in case.steps[i].outputs if name}
    steps = []
    for j, step in enumerate(case.steps):
        if j != i:  # consumers of the dropped op's outputs take public tensors instead
            inputs = [
                ("public", None) if name in gone else (how, name) for how, name in step.inputs
            ]
            steps.append(dataclasses.replace(step, inputs=inputs, outputs=list(step.outputs)))
    x_shape = case.steps[1].shape if i == 0 and len(case.steps) > 1 else case.x_shape
    return _variant(case, steps=steps, x_shape=x_shape)


def _replace_step(case, i, **changes):
    return [dataclasses.replace(s, **changes) if j == i else s for j, s in enumerate(case.steps)]


def _variant(case, **changes):
    return dataclasses.replace(case, minimized=True, **changes)


# ---------------------------------------------------------------------------------------------
# Command line: python -m fuzz_chains --minutes N | --seed S [--device cpu|cuda]


def fuzz(minutes, device, out=sys.stdout, progress=False):
    """Random seeds for `minutes`, one line per failure; returns (cases, failures, fusion
    counts)."""
    deadline = time.monotonic() + 60 * minutes
    cases, failures, counts = 0, 0, collections.Counter()
    while time.monotonic() < deadline:
        seed = int.from_bytes(os.urandom(4), "little")
        if progress:  # the seed is known even if the process dies in the case
            print(f"case {cases}: seed {seed}", file=sys.stderr, flush=True)
        cases += 1
        case = make_case(seed, device)
        try:
            counts.update(run_case(case))
        except CaseFailure as e:
            failures += 1
            headline = e.detail.splitlines()[0]
            print(f"FAIL {_one_line(case)}: {headline}", file=out, flush=True)
    return cases, failures, counts


def _one_line(case):
    chain = " > ".join(
        step.spec.name + "".join(f"({k})" for k, v in step.options.items() if v is True)
        for step in case.steps
    )
    dtype = str(case.dtype).replace("torch.", "")
    return f"seed {case.seed} {case.device} {dtype} x{list(case.x_shape)}: {chain}"


def summary(cases, failures, counts, minutes):
    lines = [f"fuzz: {cases} cases in {minutes:g} min, {failures} failures; cases per fusion:"]
    lines += [f"  {counts[name]:7d}  {name}" for name in sorted(KNOWN_FUSIONS)]
    lines.append(f"{counts[REDRAWN]} cases passed with redrawn values (a derivative kink)")
    lines.append(
        f"{counts[OUT_OF_RANGE]} cases had result elements out of the dtype's range (not compared)"
    )
    return "\n".join(lines)


def replay(seed, device, shrink):
    """Runs one case verbosely: its description, each call's plan, the failure (and with shrink
    the smallest failing variant). Returns 0 when it passes."""
    case = make_case(seed, device)
    print(describe(case))
    try:
        fusions = run_case(case)
        print(f"passed; fusions: {sorted(fusions - {REDRAWN, OUT_OF_RANGE}) or 'none'}")
        if OUT_OF_RANGE in fusions:
            print("(result elements out of the dtype's range in the unfused chain: not compared)")
        if REDRAWN in fusions:
            _print_kink_failure(case)
        return 0
    except CaseFailure as e:
        print(f"FAILED: {e.detail}")
    if shrink:
        smallest = minimize(case)
        try:
            run_case(smallest)
        except CaseFailure as e:
            print(f"\nminimized:\n{e}")
    return 1


def _print_kink_failure(case):
    try:
        run_values(case, case.seed)
    except CaseFailure as e:
        print(f"(with redrawn values: the seed's own fail near a derivative kink: {e.detail})")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fuzz_chains", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to run random seeds")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seed", type=int, help="replay this case verbosely")
    parser.add_argument("--minimize", action="store_true", help="with --seed: shrink a failure")
    parser.add_argument(
        "--progress", action="store_true", help="print each seed to stderr before running it"
    )
    args = parser.parse_args(argv)
    faulthandler.enable()
    if args.seed is not None:
        return replay(args.seed, args.device, args.minimize)
    cases, failures, counts = fuzz(args.minutes, args.device, progress=args.progress)
    print(summary(cases, failures, counts, args.minutes))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

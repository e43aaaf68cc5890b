"""FP8 entry points: `autocast`, `quantized_model_init`, `fp8_available`.

The autocast state lives in C++, per thread (an op fixes the recipe at its forward; its backward
uses that one, wherever it runs). Under an enabled autocast, BasicLinear's GEMMs (and every fusion
built on it) run FP8 GEMMs on FP8 data (fusible::fp8_cast, fusible::fp8_gemm) where the recipe and
shapes allow, and otherwise compute with their operands cast to FP8 and back
(fusible::fp8_quantize_dequantize*). `quantized_model_init` stores Linear weights in FP8
(_float8_tensor.Float8Tensor)."""

import collections
import contextlib
import threading

import torch

from . import _C
from . import recipe as _recipe
from ._float8_tensor import Float8Tensor, cast_with_scale
from .ops._distributed import group_spec


def _fp8_support(block):
    if not torch.cuda.is_available():
        return False, "FP8 needs a CUDA GPU; none is available"
    if not _C.cuda_built:
        return False, "fusible was built without CUDA kernels"
    major, minor = _C._cuda_capability()
    return _C._fp8_gemm_support(major, minor, block)


def fp8_available():
    """Whether this machine's GPU runs FP8 GEMMs with per-tensor scales (Float8CurrentScaling,
    DelayedScaling): compute capability 8.9 or newer.

    Returns:
        (True, "") or (False, the reason). Where it is False, an FP8 autocast still computes the
        recipe's numerics on CUDA (casts to FP8 and back, GEMMs in the compute dtype, with a
        warning) and on CPU (emulated).
    """
    return _fp8_support(block=False)


def fp8_block_scaling_available():
    """Whether this machine's GPU runs block-scaled FP8 GEMMs (Float8BlockScaling): Hopper,
    compute capability 9.x, as cuBLASLt offers them.

    Returns:
        (True, "") or (False, the reason); where False, Float8BlockScaling is emulated as
        fp8_available() describes.
    """
    return _fp8_support(block=True)


def _amax_group(recipe, amax_reduction_group):
    """{"amax_group": (name, size, rank), "amax_device": where its collectives run} for the group
    DelayedScaling reduces its amaxes over (te: with reduce_amax, amax_reduction_group or else the
    default group, once torch.distributed is initialized); {} for none (one process, or nothing to
    reduce)."""
    dist = torch.distributed
    if not (recipe.delayed() and recipe.reduce_amax):
        return {}
    if amax_reduction_group is None and not (dist.is_available() and dist.is_initialized()):
        return {}
    spec = group_spec("fusible.autocast", amax_reduction_group)
    if spec[1] <= 1:
        return {}
    nccl = "nccl" in str(dist.get_backend(amax_reduction_group)).lower()
    device = f"cuda:{torch.cuda.current_device()}" if nccl else "cpu"
    return {"amax_group": spec, "amax_device": device}


def _cpp_recipe(recipe, amax_reduction_group=None):
    if not isinstance(recipe, _recipe.Recipe):
        raise TypeError(
            f"fusible.autocast: expected a fusible.recipe recipe, got {type(recipe).__name__}"
        )
    fmt = recipe.fp8_format
    margin = float(getattr(recipe, "margin", 0))
    min_tokens = int(getattr(recipe, "fp8_min_tokens", 0))
    if recipe.delayed():
        algo = recipe.amax_compute_algo
        if callable(algo):
            raise NotImplementedError(
                "fusible.autocast: a callable amax_compute_algo is not supported yet; use 'max' "
                "or 'most_recent'"
            )
        if recipe.scaling_factor_compute_algo is not None:
            raise NotImplementedError(
                "fusible.autocast: scaling_factor_compute_algo is not supported yet"
            )
        return _C.Fp8Recipe(
            "delayed",
            fmt.forward_format,
            fmt.backward_format,
            margin,
            int(recipe.amax_history_len),
            algo,
            min_tokens=min_tokens,
            **_amax_group(recipe, amax_reduction_group),
        )
    if recipe.float8_block_scaling():
        return _C.Fp8Recipe(
            "block",
            fmt.forward_format,
            fmt.backward_format,
            0.0,
            x_block_dim=int(recipe.x_block_scaling_dim),
            w_block_dim=int(recipe.w_block_scaling_dim),
            grad_block_dim=int(recipe.grad_block_scaling_dim),
            min_tokens=min_tokens,
        )
    return _C.Fp8Recipe(
        recipe._kind, fmt.forward_format, fmt.backward_format, margin, min_tokens=min_tokens
    )


@contextlib.contextmanager
def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None):
    """FP8 for the ops called inside (te's `autocast`).

    Args:
        enabled (bool): False: FP8 off for the ops called inside (also inside an enabled
            autocast).
        calibrating (bool): te's keyword, accepted at False only (NotImplementedError otherwise).
        recipe: a `fusible.recipe` recipe; None: Float8CurrentScaling() (HYBRID).
        amax_reduction_group: a torch.distributed process group. Under DelayedScaling with
            reduce_amax (its default) on a distributed run, each tensor's amax history is reduced
            (max) over this group, or over the default group where it is None, so that every rank
            casts with the same scales (those of the whole tensor). The reduction is one
            collective on entry (the previous backward's amaxes) and one on exit (this forward's):
            every rank of the group enters and leaves the autocast together and runs the same FP8
            casts. Current and block scaling take each amax of the whole tensor they cast and
            reduce nothing.
    """
    if calibrating:
        raise NotImplementedError("fusible.autocast: calibrating=True is not supported yet")
    cpp = None
    if enabled:
        recipe = recipe if recipe is not None else _recipe.Float8CurrentScaling()
        cpp = _cpp_recipe(recipe, amax_reduction_group)
    global _compiled_key
    # The outermost autocast whose recipe reduces amaxes across ranks reduces (checked first).
    reduces = cpp is not None and _C._starts_amax_reduction(cpp)
    prev = _C._exchange_fp8_autocast(bool(enabled), cpp)
    prev_recipe = getattr(_autocast_recipe, "value", None)
    prev_key = _compiled_key
    _autocast_recipe.value = recipe if enabled else None
    _compiled_key = _C._fp8_recipe_key(cpp)
    try:
        if reduces:  # the previous step's backward amaxes, before this step casts
            _C._reduce_delayed_amaxes(cpp)
        yield
        if reduces:  # this forward's (not after an exception: other ranks may not come)
            _C._reduce_delayed_amaxes(cpp)
    finally:
        _C._exchange_fp8_autocast(*prev)
        _autocast_recipe.value = prev_recipe
        _compiled_key = prev_key


# The innermost autocast's recipe key ("" for none), read by a Sequential while torch.compile
# traces it: a plain global, so Dynamo guards on its value and recompiles when the recipe changes.
# (The C++ state is per thread; a compiled call checks the two agree when it runs.)
_compiled_key = ""


# The recipe object of this thread's innermost autocast (fusion functions receive it).
_autocast_recipe = threading.local()


def active_recipe(kind):
    """The recipe object in effect for a fusion pass whose C++ recipe kind is `kind` (None: FP8
    off): the autocast's own object, or a default one of that kind (an autocast entered from
    C++)."""
    if not kind:
        return None
    recipe = getattr(_autocast_recipe, "value", None)
    if recipe is not None and recipe._kind == kind:
        return recipe
    defaults = {
        "current": _recipe.Float8CurrentScaling,
        "delayed": _recipe.DelayedScaling,
        "block": _recipe.Float8BlockScaling,
    }
    return defaults[kind]() if kind in defaults else kind


_model_init = threading.local()


WeightQuantization = collections.namedtuple("WeightQuantization", "format delayed block_dim")
WeightQuantization.__doc__ = """How weights built under quantized_model_init are stored: the FP8
format, whether writes follow delayed scaling's scale (else a fresh amax's), and the block size
(2: 128x128 tiles) under block scaling, else None."""


def model_init_weights():
    """The WeightQuantization of weights built now (quantized_model_init), or None."""
    return getattr(_model_init, "weights", None)


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """Linear weights built inside are stored in FP8 (te's `quantized_model_init`): fusible's
    Float8Tensor, FP8 data with a per-tensor scale in the recipe's forward format, which FP8 GEMMs
    read as it is and which an optimizer step quantizes again. A weight built on the meta device
    is quantized when reset_parameters() materializes it.

    Args:
        enabled (bool): False: weights built inside are plain, also inside an enabled
            quantized_model_init (te's rule).
        recipe: the `fusible.recipe` recipe whose forward format and scaling the weights follow
            (None: Float8CurrentScaling()).
        preserve_high_precision_init_val: te's keyword, accepted at False only
            (NotImplementedError otherwise).
    """
    prev = model_init_weights()
    if not enabled:  # weights built inside are plain, also inside an enabled one (te's)
        _model_init.weights = None
        try:
            yield
        finally:
            _model_init.weights = prev
        return
    if preserve_high_precision_init_val:
        raise NotImplementedError(
            "fusible.quantized_model_init: preserve_high_precision_init_val is not supported yet"
        )
    r = recipe if recipe is not None else _recipe.Float8CurrentScaling()
    _cpp_recipe(r)  # type and support checks
    block = r.float8_block_scaling()
    if block and r.w_block_scaling_dim != 2:
        raise NotImplementedError(
            "fusible.quantized_model_init: block-scaled FP8 weights are stored in 128x128 tiles "
            f"(w_block_scaling_dim=2), got w_block_scaling_dim={r.w_block_scaling_dim}"
        )
    _model_init.weights = WeightQuantization(
        r.fp8_format.forward_format, r.delayed(), 2 if block else None
    )
    try:
        yield
    finally:
        _model_init.weights = prev


_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Float8CurrentScalingQuantizer:
    """An op's quantizer under Float8CurrentScaling (te's class name): its FP8 dtype; the scale
    comes from each tensor's own amax when it is cast."""

    def __init__(self, fp8_dtype):
        self.dtype = fp8_dtype

    def __repr__(self):
        return f"Float8CurrentScalingQuantizer(dtype={self.dtype})"


class Float8Quantizer:
    """An op's quantizer under DelayedScaling (te's class name): its FP8 dtype, the scale its
    next cast uses and its amax history (newest first), as live views of the op's state."""

    def __init__(self, scale, amax_history, fp8_dtype):
        self.scale, self.amax_history, self.dtype = scale, amax_history, fp8_dtype

    @property
    def amax(self):
        return self.amax_history[:1]

    def __repr__(self):
        return f"Float8Quantizer(dtype={self.dtype}, scale={self.scale.item():g})"


def has_quantizers(cpp_op):
    """Whether a C++ basic op holds quantizers: it ran under fusible.autocast or
    reset_recipe_state(recipe=...) made them (and no reset_recipe_state(recipe=None) since)."""
    r = _C._fp8_recipe(cpp_op)
    return r is not None and (r.kind != "delayed" or _C._fp8_state(cpp_op) is not None)


def quantizer_view(cpp_op, mode, index):
    """The quantizer object of a C++ basic op that has quantizers (has_quantizers)."""
    r = _C._fp8_recipe(cpp_op)
    dtype = _TORCH_FP8[r.forward_format if mode == "forward" else r.backward_format]
    if r.kind == "delayed":
        amax_history, scale = _C._fp8_state(cpp_op)[mode][index]
        return Float8Quantizer(scale, amax_history, dtype)
    return Float8CurrentScalingQuantizer(dtype)


class _AsFloat8(torch.autograd.Function):
    """y (already on the FP8 grid of its cast) as a Float8Tensor; the gradient passes through."""

    @staticmethod
    def forward(ctx, y, fmt, scale):
        if scale is None:  # current scaling: y's own amax gives the cast's scale back
            return Float8Tensor.quantize(y, fmt)
        return Float8Tensor(cast_with_scale(y, fmt, scale), scale.reciprocal(), fmt, y.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (grad.dequantize() if isinstance(grad, Float8Tensor) else grad), None, None


class _GradAsFloat8(torch.autograd.Function):
    """Identity forward; the backward hands the gradient (already on the FP8 grid: the next
    node is ops.Quantize's backward cast) on as a Float8Tensor, as te.ops' Quantize does."""

    @staticmethod
    def forward(ctx, x, fmt, cpp_op):
        ctx.fmt, ctx.cpp_op = fmt, cpp_op
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.cpp_op.last_backward_scale  # delayed scaling's; None: the grad's own amax
        if isinstance(grad, Float8Tensor) or grad.dtype not in _FP8_GEMM_DTYPES:
            return grad, None, None
        if scale is None:
            return Float8Tensor.quantize(grad, ctx.fmt), None, None
        scale = scale.to(grad.device)
        data = cast_with_scale(grad, ctx.fmt, scale)
        return Float8Tensor(data, scale.reciprocal(), ctx.fmt, grad.dtype), None, None


_FP8_GEMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantized_grad(x, cpp_op):
    """x, through which ops.Quantize(backward=True)'s gradient leaves as te.ops hands it on: under
    a per-tensor FP8 autocast a Float8Tensor (its values exactly those the cast produced); else x
    itself (no autocast, block scaling, no gradient, or a dtype no FP8 GEMM takes)."""
    recipe = getattr(_autocast_recipe, "value", None)
    if recipe is None or recipe.float8_block_scaling():
        return x
    if not (torch.is_grad_enabled() and x.requires_grad) or x.dtype not in _FP8_GEMM_DTYPES:
        return x
    return _GradAsFloat8.apply(x, recipe.fp8_format.backward_format, cpp_op)


def output_scale(cpp_op):
    """The scale an op's next forward cast uses under a DelayedScaling autocast (its state's,
    1.0 before the first one), read before that forward; None under other recipes."""
    recipe = getattr(_autocast_recipe, "value", None)
    if recipe is None or not recipe.delayed():
        return None
    state = _C._fp8_state(cpp_op)
    if state is None or not state["forward"]:
        return torch.ones(1)
    return state["forward"][0][1].detach().clone()


def quantized_output(y, scale=None):
    """ops.Quantize's output as te.ops returns it: under a per-tensor FP8 autocast a Float8Tensor
    holding the values the cast produced (exactly: they are on its grid; `scale`: the delayed
    scaling scale that cast used, from output_scale), which the next op's FP8 GEMM reads as it is
    and any other module sees dequantized; otherwise (no autocast, block scaling, float64, which
    no FP8 GEMM takes) y itself."""
    recipe = getattr(_autocast_recipe, "value", None)
    if recipe is None or recipe.float8_block_scaling():
        return y
    if y.dtype not in _FP8_GEMM_DTYPES:
        return y
    scale = None if scale is None else scale.to(y.device)
    return _AsFloat8.apply(y, recipe.fp8_format.forward_format, scale)

"""The built-in basic operations (API.md's table) and the composite Linear.

Each class keeps its constructor arguments as attributes: `_make_cpp` rebuilds the C++ op from them
(copies, pickling) and `extra_repr` shows them."""

import weakref

import torch

from .. import _C, quantization
from ._base import (
    BasicOperation,
    FusedOperation,
    _device,
    _dtype,
    _fp8_weights_pending,
    drop_empty_te_extra_state,
    quantize_fp8_weights,
    reject_unsupported,
)
from ._collectives import AllReduce, ReduceScatter
from ._distributed import (
    grad_reduction_spec,
    group_spec,
    sum_over_group,
    tensor_parallel_args,
    with_grad_reduction,
)


def _normalized_shape(shape):
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


class Identity(BasicOperation):
    """y = x. Saves nothing for backward."""

    def __init__(self):
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.Identity()


class Reshape(BasicOperation):
    """y = x.reshape(shape); the backward reshapes to the input's shape.

    Args:
        shape: the output shape; one entry may be -1.
    """

    _repr_fields = ("shape",)

    def __init__(self, shape):
        self.shape = tuple(int(s) for s in shape)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.Reshape(list(self.shape))

    @property
    def _shape(self):  # te.ops' attribute name
        return self.shape


class ConstantScale(BasicOperation):
    """y = scale * x.

    Args:
        scale (float): the constant factor.
    """

    _repr_fields = ("scale",)

    def __init__(self, scale):
        self.scale = float(scale)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.ConstantScale(self.scale)


class Bias(BasicOperation):
    """y = x + bias over the last dim; parameter `bias` [size], initialized to zeros.

    Args:
        size (int): length of the last dim.
        device: where the parameter lives (None: see API.md; "meta" defers allocation).
        dtype: parameter dtype (None: torch's default dtype).
        tensor_parallel (bool): the bias is sharded over `tensor_parallel_group` (None: the
            default group): this rank holds `local_size` = size / group size entries (te.ops').
        sequence_parallel (bool): the bias is replicated on every rank of
            `tensor_parallel_group` while the rows of x are sharded over it (after a
            reduce-scatter): the backward sums the bias gradient over the group, so the replicas
            take the same step (not with tensor_parallel; an extension of te.ops' Bias).
    """

    _repr_fields = ("size",)
    # Read-only after construction (the C++ op's gradient reduction is set when it is built).
    sequence_parallel = property(lambda self: self._sequence_parallel)

    def __init__(
        self,
        size,
        *,
        device=None,
        dtype=None,
        tensor_parallel=False,
        tensor_parallel_group=None,
        sequence_parallel=False,
        _cpp=None,
    ):
        self.size = int(size)
        if tensor_parallel and sequence_parallel:
            raise ValueError(
                "Bias: sequence_parallel is for a replicated bias; a tensor_parallel bias is "
                "sharded (expected at most one of them, got both)"
            )
        self._grad_reduction = grad_reduction_spec("Bias", sequence_parallel, tensor_parallel_group)
        self._sequence_parallel = self._grad_reduction is not None
        group_size = group_spec("Bias", tensor_parallel_group)[1] if tensor_parallel else 1
        if self.size % group_size != 0:
            raise ValueError(
                "Bias: invalid configuration for tensor parallelism "
                f"(size={self.size}, tensor_parallel_size={group_size})"
            )
        self.tensor_parallel = group_size > 1  # te.ops' attributes
        parallel = self.tensor_parallel or self._sequence_parallel
        self.tensor_parallel_group = tensor_parallel_group if parallel else None
        self.tensor_parallel_size = group_size
        self.local_size = self.size // group_size
        if _cpp is None:  # else: made by a composite (Linear), configured as these keywords say
            _cpp = self._make_cpp(_device(device), _dtype(dtype))
        super().__init__(_cpp)

    def _make_cpp(self, device, dtype):
        return with_grad_reduction(_C.Bias(self.local_size, device, dtype), self._grad_reduction)


class BasicLinear(BasicOperation):
    """y = x W^T; parameter `weight` [out_features, in_features], kaiming-uniform like
    torch.nn.Linear.

    Args:
        in_features (int), out_features (int): sizes of x's and y's last dim.
        device: where the weight lives (None: see API.md; "meta" defers allocation).
        dtype: weight dtype (None: torch's default dtype).
        tensor_parallel_mode (None, "column" or "row"): te.ops' tensor parallelism over
            `tensor_parallel_group` (None: the default group; one process: none). "column": this
            rank holds weight rows [out_features / size, in_features] and outputs its slice of
            features; "row": it holds [out_features, in_features / size], takes its slice of
            input features and the output is all-reduced. The backward runs the adjoint
            collectives; a column-parallel input gradient's reduction overlaps the weight-gradient
            GEMM. in_features / out_features are the global sizes (`local_in_features`,
            `local_out_features`: this rank's).
        sequence_parallel (bool): with tensor parallelism, dim 0 of the column-parallel input (and
            of the row-parallel output) is sharded over the group: all-gathered before the GEMM,
            reduce-scattered after it.
        accumulate_into_main_grad (bool): the backward adds the weight gradient into
            `weight.main_grad` (Megatron's buffer; RuntimeError when missing) instead of
            `weight.grad`, or overwrites it where `weight.overwrite_main_grad` is set; autograd
            then gets a dummy gradient where the weight has `grad_added_to_main_grad` (set to
            True; zeros where `weight.zero_out_wgrad`), else none (te.ops' convention).
        rng_state_tracker_function, userbuffers_options: te.ops
            keywords, accepted at their defaults only (NotImplementedError otherwise).
    """

    _repr_fields = ("in_features", "out_features")
    # te.ops' attribute, which its fusion functions read: no Userbuffers here.
    _userbuffers_options = None

    @property
    def _accumulate_into_main_grad(self):  # te.ops' attribute name
        return self.accumulate_into_main_grad

    def __init__(
        self,
        in_features,
        out_features,
        *,
        device=None,
        dtype=None,
        tensor_parallel_mode=None,
        tensor_parallel_group=None,
        sequence_parallel=False,
        rng_state_tracker_function=None,
        accumulate_into_main_grad=False,
        userbuffers_options=None,
        _cpp=None,
    ):
        reject_unsupported(
            "BasicLinear",
            rng_state_tracker_function=(rng_state_tracker_function, None),
            userbuffers_options=(userbuffers_options, None),
        )
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._tp_args = tensor_parallel_args(
            "BasicLinear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        if _cpp is None:  # else: made by a composite (Linear), configured as these keywords say
            _cpp = self._make_cpp(_device(device), _dtype(dtype))
        elif self.accumulate_into_main_grad:
            self._set_main_grad_hook(_cpp)
        super().__init__(_cpp)
        # te.ops' attributes, after its canonicalization (one process: no tensor parallelism).
        self.tensor_parallel_mode = self._cpp.tensor_parallel_mode or None
        parallel = self.tensor_parallel_mode is not None
        self.tensor_parallel_group = tensor_parallel_group if parallel else None
        self.tensor_parallel_size = self._tp_args["group_size"] if parallel else 1
        self.sequence_parallel = bool(sequence_parallel) and parallel
        self.local_in_features = self._cpp.local_in_features
        self.local_out_features = self._cpp.local_out_features
        # Under quantized_model_init: the weight in FP8 now, or when materialized.
        self._fp8_weight = quantization.model_init_weights()
        if self._fp8_weight is not None:
            if self.weight.is_meta:
                _fp8_weights_pending.add(self)
            quantize_fp8_weights(self)

    def _make_cpp(self, device, dtype):
        cpp = _C.BasicLinear(self.in_features, self.out_features, device, dtype, **self._tp_args)
        if self.accumulate_into_main_grad:
            self._set_main_grad_hook(cpp)
        return cpp

    def _set_main_grad_hook(self, cpp):
        cpp.set_main_grad_hook(_main_grad_hook(weakref.ref(self)))


def _main_grad_hook(op_ref):
    """BasicLinear's backward hook under accumulate_into_main_grad (te.ops' semantics)."""
    return lambda dw: _into_main_grad(op_ref().weight, dw, "BasicLinear")


def _into_main_grad(weight, dw, op_label):
    """dw added into weight.main_grad (or written, with overwrite_main_grad); returns what
    autograd gets as the weight's gradient: te.ops' dummy convention, else None."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{op_label} operation is configured with accumulate_into_main_grad=True, "
            "but weight parameter does not have a valid main_grad attribute"
        )
    if tuple(main_grad.shape) != tuple(dw.shape):
        raise RuntimeError(
            f"{op_label}: weight.main_grad has shape {tuple(main_grad.shape)}, expected "
            f"the weight's {tuple(dw.shape)}"
        )
    with torch.no_grad():
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(dw)
            return main_grad  # te.ops returns main_grad itself as the weight's gradient
        main_grad.add_(dw)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


class GroupedLinear(BasicOperation):
    """The rows of x split into num_groups consecutive groups by split sizes (extra input 0: a 1-D
    int32 or int64 tensor, one non-negative entry per group, summing to x's rows); group g computes
    y_g = x_g W_g^T (+ b_g). Parameters weight0..weight{N-1} [out_features, in_features]
    (kaiming-uniform as torch.nn.Linear), bias0..bias{N-1} [out_features] (zeros).

    Args:
        num_groups (int), in_features (int), out_features (int): as above.
        bias (bool): add a learnable bias per group.
        device, dtype: of the parameters (None: see API.md; "meta" defers allocation).
        scale_bias (bool): with bias, extra input 1 is a per-row scale [rows] (the router's
            probabilities) and each row adds bias_g * its scale; the scales get a gradient.
        accumulate_into_main_grad (bool): each weight's gradient goes into its `main_grad`, as
            BasicLinear's.
        single_grouped_weight (bool): one parameter `weight` [num_groups, out, in] instead of
            weight0.. (te.ops' GroupedTensor parameter, here a plain tensor).
        single_grouped_bias (bool): likewise one `bias` [num_groups, out].
        rng_state_tracker_function, delay_wgrad_compute: te.ops keywords, accepted at their
            defaults only (NotImplementedError otherwise).

    A call's op_kwargs may hand it te.ops' buffers: "output" (x's shape with out_features last)
    receives the output, which is that tensor; "grad_input" (x's shape) receives the input's
    gradient, which is that tensor. Each contiguous, in the compute dtype, on x's device and not
    requiring grad (pass buffer.detach()); ValueError otherwise. The results are computed apart
    and copied in (te.ops' GEMMs write them in place).
    """

    _buffer_keywords = ("output", "grad_input")

    _repr_fields = ("num_groups", "in_features", "out_features")

    def _fp8_weight_names(self):
        return [f"weight{g}" for g in range(self.num_groups)]

    def __init__(
        self,
        num_groups,
        in_features,
        out_features,
        *,
        bias=True,
        device=None,
        dtype=None,
        rng_state_tracker_function=None,
        accumulate_into_main_grad=False,
        single_grouped_weight=False,
        single_grouped_bias=False,
        delay_wgrad_compute=False,
        scale_bias=False,
    ):
        reject_unsupported(
            "GroupedLinear",
            rng_state_tracker_function=(rng_state_tracker_function, None),
            delay_wgrad_compute=(delay_wgrad_compute, False),
        )
        self.num_groups, self.in_features = int(num_groups), int(in_features)
        self.out_features, self.use_bias = int(out_features), bool(bias)
        self._scale_bias = bool(scale_bias) and self.use_bias  # te.ops' attribute
        self._accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self.single_grouped_weight = bool(single_grouped_weight)  # te.ops' attributes
        self.single_grouped_bias = bool(single_grouped_bias) and self.use_bias
        fp8_weight = quantization.model_init_weights()
        if fp8_weight is not None and self.single_grouped_weight:
            raise NotImplementedError(
                "GroupedLinear: single_grouped_weight=True under fusible.quantized_model_init is "
                "not supported yet (FP8 weights are stored per group: weight0, weight1, ...)"
            )
        super().__init__(self._make_cpp(_device(device), _dtype(dtype)))
        # Under quantized_model_init: each group's weight in FP8 (its own scale), now or when
        # materialized.
        self._fp8_weight = fp8_weight
        if fp8_weight is not None:
            if self.weight0.is_meta:
                _fp8_weights_pending.add(self)
            quantize_fp8_weights(self)

    @property
    def has_bias(self):  # te.ops' attribute name
        return self.use_bias

    def _make_cpp(self, device, dtype):
        cpp = _C.GroupedLinear(
            self.num_groups,
            self.in_features,
            self.out_features,
            self.use_bias,
            device,
            dtype,
            self._scale_bias,
            self.single_grouped_weight,
            self.single_grouped_bias,
        )
        if self._accumulate_into_main_grad:
            op_ref = weakref.ref(self)
            single = self.single_grouped_weight

            def hook(i, dw):
                weight = getattr(op_ref(), "weight" if single else f"weight{i}")
                return _into_main_grad(weight, dw, "GroupedLinear")

            cpp.set_main_grad_hook(hook)
        return cpp


class Quantize(BasicOperation):
    """Casts x (forward=True) and/or the gradient dy (backward=True) to FP8 under an FP8
    autocast, with its recipe's formats; identity otherwise (te.ops' Quantize). Where its output
    leaves fusible (called alone, or last in a Sequential) under a per-tensor recipe, it is a
    Float8Tensor, as te.ops returns a quantized tensor: the next op's FP8 GEMM reads its data as
    it is, any other module sees its dequantized values. Inside a fuser group the next op gets the
    cast values, which its own cast leaves unchanged under current scaling (they are on the grid;
    under DelayedScaling the next op's own quantizer casts them again, where te.ops would read
    them as they are). Likewise the backward's gradient leaves fusible (Quantize called alone, or
    first in a Sequential) as a Float8Tensor under a per-tensor recipe; inside a group the op
    before it gets the cast values.

    Args:
        forward (bool): quantize the forward's tensor (default True).
        backward (bool): quantize the backward's gradient (default False).
    """

    _repr_fields = ()

    def __init__(self, *, forward=True, backward=False):
        # te.ops' attribute names (`forward` is the module's method).
        self._quantize_forward, self._quantize_backward = bool(forward), bool(backward)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.Quantize(self._quantize_forward, self._quantize_backward)

    def forward(self, input, *extra_inputs, **kwargs):
        if self._quantize_backward:  # its gradient leaves fusible here: handed on quantized
            input = quantization.quantized_grad(input, self._cpp)
        if not self._quantize_forward:
            return super().forward(input, *extra_inputs, **kwargs)
        scale = quantization.output_scale(self._cpp)
        y = super().forward(input, *extra_inputs, **kwargs)
        return quantization.quantized_output(y, scale)

    def extra_repr(self):
        return f"forward={self._quantize_forward}, backward={self._quantize_backward}"


class _Norm(BasicOperation):
    _repr_fields = ("normalized_shape", "eps", "zero_centered_gamma")
    _cpp_class = None
    # Read-only after construction (the C++ op's gradient reduction is set when it is built).
    sequence_parallel = property(lambda self: self._sequence_parallel)

    def __init__(
        self,
        normalized_shape,
        *,
        eps=1e-5,
        device=None,
        dtype=None,
        zero_centered_gamma=False,
        sm_margin=0,
        sequence_parallel=False,
        tensor_parallel_group=None,
    ):
        reject_unsupported(type(self).__name__, sm_margin=(sm_margin, 0))
        self.normalized_shape = _normalized_shape(normalized_shape)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self._grad_reduction = grad_reduction_spec(
            type(self).__name__, sequence_parallel, tensor_parallel_group
        )
        self._sequence_parallel = self._grad_reduction is not None
        self.tensor_parallel_group = tensor_parallel_group if self._sequence_parallel else None
        super().__init__(self._make_cpp(_device(device), _dtype(dtype)))

    def _make_cpp(self, device, dtype):
        cpp = type(self)._cpp_class(
            list(self.normalized_shape), self.eps, device, dtype, self.zero_centered_gamma
        )
        return with_grad_reduction(cpp, self._grad_reduction)


class LayerNorm(_Norm):
    """Layer norm over the trailing `normalized_shape` dims; parameters `weight` (ones, or zeros
    with zero_centered_gamma, which applies 1 + weight) and `bias` (zeros).

    Args:
        normalized_shape (int or tuple): the trailing dims normalized over.
        eps (float): added to the variance.
        device, dtype: of the parameters (None: see API.md; "meta" defers allocation).
        zero_centered_gamma (bool): store the scale minus one.
        sm_margin: te.ops keyword, accepted at its default only.
        sequence_parallel (bool), tensor_parallel_group: the rows of x are sharded over the group
            (None: the default group) and the parameters replicated: the backward sums their
            gradients over it, so every replica takes the single-process model's step (an
            extension of te.ops, where Megatron-LM sums them outside the op).
    """

    _cpp_class = _C.LayerNorm


class RMSNorm(_Norm):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims.

    Args:
        normalized_shape (int or tuple): the trailing dims normalized over.
        eps (float): added to the mean square.
        device, dtype: of the parameter (None: see API.md; "meta" defers allocation).
        zero_centered_gamma (bool): store the scale minus one.
        sm_margin: te.ops keyword, accepted at its default only.
        sequence_parallel (bool), tensor_parallel_group: as LayerNorm's.
    """

    _cpp_class = _C.RMSNorm


class L2Normalization(BasicOperation):
    """y = x * rsqrt(sum(x^2) + eps) over the last dim.

    Args:
        eps (float): added to the sum of squares.
        seq_length, micro_batch_size: te.ops keywords, accepted at their defaults only.
    """

    _repr_fields = ("eps",)

    def __init__(self, *, eps=1e-6, seq_length=None, micro_batch_size=None):
        reject_unsupported(
            "L2Normalization",
            seq_length=(seq_length, None),
            micro_batch_size=(micro_batch_size, None),
        )
        self.eps = float(eps)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.L2Normalization(self.eps)


def _interleave_size(name, glu_interleave_size):
    """te.ops' glu_interleave_size (None: plain [a | b] halves) as the C++ ops take it (0)."""
    if glu_interleave_size is None:
        return 0
    if isinstance(glu_interleave_size, bool) or int(glu_interleave_size) != glu_interleave_size:
        raise TypeError(f"{name}: glu_interleave_size must be an int or None")
    if glu_interleave_size <= 0:
        raise ValueError(
            f"{name}: glu_interleave_size must be positive or None, got {glu_interleave_size}"
        )
    return int(glu_interleave_size)


class _RecomputeInMlp:
    """te.ops' activation_recompute_in_mlp on the row-scaled activations (read-only after
    construction). fusible's fused expert MLP (GroupedMLP_GroupedGEMMGLU) always recomputes fc2's
    input from the activation's input in the backward instead of keeping it, and these ops never
    save their output, so True is what runs; False (te.ops' default, which keeps fc2's input in
    its fused path) computes the same values."""

    @property
    def activation_recompute_in_mlp(self):
        return self._activation_recompute_in_mlp


def _with_cache(cpp, cache_quantized_input):
    """cpp with te.ops' cache_quantized_input set (see _CACHE_DOC)."""
    cpp.cache_quantized_input = bool(cache_quantized_input)
    return cpp


# Read-only after construction (plans depend on it): assigning raises AttributeError.
_CACHE_PROPERTY = property(
    lambda self: self._cache_quantized_input, doc="te.ops' cache_quantized_input (read-only)."
)


_CACHE_DOC = (
    "cache_quantized_input (bool): the backward keeps x as E4M3 data with a current-scaling\n"
    "            scale (a byte per element, te.ops' memory saving) and computes the gradient\n"
    "            from its dequantized values, with or without an FP8 autocast; GEMM-epilogue\n"
    "            fusions then leave the op unfused."
)


def _activation(name, doc, gated=False):
    """A Python face for the C++ activation class `name` (the concrete class, so C++ fusions
    match it by type). Gated ones take te.ops' glu_interleave_size."""
    cpp_cls = getattr(_C, name)

    if gated:

        def __init__(self, *, cache_quantized_input=False, glu_interleave_size=None):
            self._cache_quantized_input = bool(cache_quantized_input)
            self.glu_interleave_size = glu_interleave_size
            BasicOperation.__init__(self, self._make_cpp(None, None))

        def _make_cpp(self, device, dtype):
            cpp = cpp_cls(_interleave_size(name, self.glu_interleave_size))
            return _with_cache(cpp, self._cache_quantized_input)

    else:

        def __init__(self, *, cache_quantized_input=False):
            self._cache_quantized_input = bool(cache_quantized_input)
            BasicOperation.__init__(self, self._make_cpp(None, None))

        def _make_cpp(self, device, dtype):
            return _with_cache(cpp_cls(), self._cache_quantized_input)

    if gated:
        doc += (
            "\n\n    Args:\n        glu_interleave_size (int or None): x's last dim holds"
            " alternating blocks\n            of that many a and b columns (te.ops' layout)."
            f"\n        {_CACHE_DOC}"
        )
    else:
        doc += f"\n\n    Args:\n        {_CACHE_DOC}"
    # Named as the class's own, so a wrong keyword's TypeError names the op (GELU.__init__()).
    __init__.__qualname__, _make_cpp.__qualname__ = f"{name}.__init__", f"{name}._make_cpp"
    attrs = {"__init__": __init__, "_make_cpp": _make_cpp, "__doc__": doc, "__module__": __name__}
    attrs["cache_quantized_input"] = _CACHE_PROPERTY
    if gated:
        attrs["_repr_fields"] = ("glu_interleave_size",)
    return type(name, (BasicOperation,), attrs)


_GATED = "the last dim splits into halves [a, b]; y = {}(a) * b (the first half is gated)"
GELU = _activation("GELU", "y = gelu(x), tanh approximation.")
QGELU = _activation("QGELU", "y = x * sigmoid(1.702 x).")
ReLU = _activation("ReLU", "y = max(x, 0).")
SReLU = _activation("SReLU", "y = max(x, 0)^2.")
SiLU = _activation("SiLU", "y = x * sigmoid(x).")
GLU = _activation("GLU", _GATED.format("sigmoid"), gated=True)
GEGLU = _activation("GEGLU", _GATED.format("gelu_tanh"), gated=True)
QGEGLU = _activation("QGEGLU", _GATED.format("qgelu"), gated=True)
ReGLU = _activation("ReGLU", _GATED.format("relu"), gated=True)
SReGLU = _activation("SReGLU", _GATED.format("srelu"), gated=True)
SwiGLU = _activation("SwiGLU", _GATED.format("silu"), gated=True)


class ClampedSwiGLU(BasicOperation):
    """GPT-OSS SwiGLU: a = min(a, limit), b = clamp(b, -limit, limit),
    y = a * sigmoid(alpha * a) * (b + glu_linear_offset).

    Args:
        limit (float), alpha (float), glu_linear_offset (float): as above.
        glu_interleave_size (int or None): as SwiGLU's.
        cache_quantized_input (bool): as SwiGLU's.
    """

    _repr_fields = ("limit", "alpha", "glu_linear_offset", "glu_interleave_size")
    cache_quantized_input = _CACHE_PROPERTY

    def __init__(
        self,
        *,
        limit=7.0,
        alpha=1.702,
        glu_linear_offset=1.0,
        cache_quantized_input=False,
        glu_interleave_size=None,
    ):
        self._cache_quantized_input = bool(cache_quantized_input)
        self.limit, self.alpha = float(limit), float(alpha)
        self.glu_linear_offset = float(glu_linear_offset)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        k = _interleave_size("ClampedSwiGLU", self.glu_interleave_size)
        cpp = _C.ClampedSwiGLU(self.limit, self.alpha, self.glu_linear_offset, k)
        return _with_cache(cpp, self._cache_quantized_input)


class SiTUGLU(BasicOperation):
    """SiTU GLU: y = beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) on halves [a, b]
    (|y| <= beta1 * beta2).

    Args:
        beta1, beta2 (float > 0): the gate's and the linear half's caps.
        glu_interleave_size (int or None): as SwiGLU's.
        cache_quantized_input (bool): as SwiGLU's.
    """

    _repr_fields = ("beta1", "beta2", "glu_interleave_size")
    cache_quantized_input = _CACHE_PROPERTY

    def __init__(
        self, *, beta1=4.0, beta2=25.0, cache_quantized_input=False, glu_interleave_size=None
    ):
        self._cache_quantized_input = bool(cache_quantized_input)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        k = _interleave_size("SiTUGLU", self.glu_interleave_size)
        return _with_cache(_C.SiTUGLU(self.beta1, self.beta2, k), self._cache_quantized_input)


class ScaledSwiGLU(_RecomputeInMlp, BasicOperation):
    """y = scales[..., None] * swiglu(x); scales (extra input 0) has x's shape without the last
    dim.

    Args:
        glu_interleave_size (int or None): as SwiGLU's.
        activation_recompute_in_mlp (bool): te.ops' keyword; see _RecomputeInMlp (the fused
            expert MLP recomputes fc2's input either way).
    """

    _repr_fields = ("glu_interleave_size",)

    def __init__(self, glu_interleave_size=None, *, activation_recompute_in_mlp=False):
        self._activation_recompute_in_mlp = bool(activation_recompute_in_mlp)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.ScaledSwiGLU(_interleave_size("ScaledSwiGLU", self.glu_interleave_size))


class ScaledSiTUGLU(_RecomputeInMlp, BasicOperation):
    """y = scales[..., None] * situglu(x) (SiTUGLU's formula); scales (extra input 0) has x's
    shape without the last dim.

    Args:
        glu_interleave_size (int or None): as SwiGLU's.
        beta1, beta2 (float > 0): as SiTUGLU's.
        activation_recompute_in_mlp (bool): te.ops' keyword; see _RecomputeInMlp (the fused
            expert MLP recomputes fc2's input either way).
    """

    _repr_fields = ("beta1", "beta2", "glu_interleave_size")

    def __init__(
        self, glu_interleave_size=None, *, activation_recompute_in_mlp=False, beta1=4.0, beta2=25.0
    ):
        self._activation_recompute_in_mlp = bool(activation_recompute_in_mlp)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        k = _interleave_size("ScaledSiTUGLU", self.glu_interleave_size)
        return _C.ScaledSiTUGLU(self.beta1, self.beta2, k)


class ScaledClampedQGeGLU(_RecomputeInMlp, BasicOperation):
    """y = scales[..., None] * ClampedSwiGLU's formula (te.ops' name for the clamped quick-GELU
    GLU); scales (extra input 0) has x's shape without the last dim.

    Args:
        glu_interleave_size (int or None): as SwiGLU's.
        limit, alpha, glu_linear_offset (float): as ClampedSwiGLU's.
        activation_recompute_in_mlp (bool): te.ops' keyword; see _RecomputeInMlp (the fused
            expert MLP recomputes fc2's input either way).
    """

    _repr_fields = ("limit", "alpha", "glu_linear_offset", "glu_interleave_size")

    def __init__(
        self,
        glu_interleave_size=None,
        *,
        activation_recompute_in_mlp=False,
        limit=7.0,
        alpha=1.702,
        glu_linear_offset=1.0,
    ):
        self._activation_recompute_in_mlp = bool(activation_recompute_in_mlp)
        self.limit, self.alpha = float(limit), float(alpha)
        self.glu_linear_offset = float(glu_linear_offset)
        self.glu_interleave_size = glu_interleave_size
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        k = _interleave_size("ScaledClampedQGeGLU", self.glu_interleave_size)
        return _C.ScaledClampedQGeGLU(self.limit, self.alpha, self.glu_linear_offset, k)

    @property
    def _clamped(self):
        """te.ops' child ClampedSwiGLU (its fusion functions read limit, alpha and the offset)."""
        return ClampedSwiGLU(
            limit=self.limit, alpha=self.alpha, glu_linear_offset=self.glu_linear_offset
        )


class ScaledSReLU(_RecomputeInMlp, BasicOperation):
    """y = scales[..., None] * max(x, 0)^2; scales (extra input 0) has x's shape without the last
    dim.

    Args:
        activation_recompute_in_mlp (bool): te.ops' keyword; see _RecomputeInMlp (the fused
            expert MLP recomputes fc2's input either way).
    """

    def __init__(self, *, activation_recompute_in_mlp=False):
        self._activation_recompute_in_mlp = bool(activation_recompute_in_mlp)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.ScaledSReLU()


class ScaledTanhSReLU(_RecomputeInMlp, BasicOperation):
    """y = scales[..., None] * (c tanh(max(x, 0) / c))^2 with c = tanh_clamp_scale: a squared
    ReLU saturating at c^2; scales (extra input 0) has x's shape without the last dim.

    Args:
        tanh_clamp_scale (float > 0): c above (required, as in te.ops).
        activation_recompute_in_mlp (bool): te.ops' keyword; see _RecomputeInMlp (the fused
            expert MLP recomputes fc2's input either way).
    """

    _repr_fields = ("tanh_clamp_scale",)

    def __init__(self, *, tanh_clamp_scale, activation_recompute_in_mlp=False):
        self._activation_recompute_in_mlp = bool(activation_recompute_in_mlp)
        self.tanh_clamp_scale = float(tanh_clamp_scale)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.ScaledTanhSReLU(self.tanh_clamp_scale)


class AddExtraInput(BasicOperation):
    """y = x + extra (extra input 0).

    Args:
        in_place (bool): add into the extra tensor's storage and return it.
    """

    _repr_fields = ("in_place",)

    def __init__(self, *, in_place=False):
        self.in_place = bool(in_place)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.AddExtraInput(self.in_place)

    @property
    def _in_place(self):  # te.ops' attribute name
        return self.in_place


class MakeExtraOutput(BasicOperation):
    """y = x and extra output 0 = x (the same tensor); dx = dy + d(extra).

    Args:
        in_place (bool): accumulate the extra gradient into dy's storage when it can.
    """

    _repr_fields = ("in_place",)

    def __init__(self, *, in_place=False):
        self.in_place = bool(in_place)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.MakeExtraOutput(self.in_place)

    @property
    def _in_place(self):  # te.ops' attribute name
        return self.in_place


class Dropout(BasicOperation):
    """Dropout with probability p in training mode, identity in eval mode.

    Args:
        p (float): probability of zeroing an element.
    """

    _repr_fields = ("p",)

    def __init__(self, p):
        self.p = float(p)
        super().__init__(self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return _C.Dropout(self.p)

    @property
    def dropout_probability(self):  # te.ops' attribute name
        return self.p


class Linear(FusedOperation):
    """y = x W^T + b: the composite BasicLinear + Bias. `weight` and `bias` are the basic ops' own
    Parameters, under torch.nn.Linear's state-dict keys.

    Args:
        in_features (int), out_features (int): sizes of x's and y's last dim.
        bias (bool): add a learnable bias.
        device, dtype: of the parameters (None: see API.md; "meta" defers allocation).
        accumulate_into_main_grad (bool): as BasicLinear's.
        tensor_parallel_mode, tensor_parallel_group, sequence_parallel: as BasicLinear's.
            Column parallel: BasicLinear(column) + this rank's slice of the bias. Row parallel:
            BasicLinear(row), whose output is all-reduced (reduce-scattered with
            sequence_parallel), then the bias, replicated on every rank and added once after the
            reduction (Megatron-LM's RowParallelLinear), so the model trains as the
            single-process one: its gradient is the full bias gradient on every rank (summed
            over the group under sequence parallelism).
        row_parallel_bias ("replicated" or "summand"): "summand" is te.ops' row-parallel layout,
            for reproducing te.ops' numbers step for step: a local GEMM, a per-rank bias summand
            [out_features] added before an AllReduce / ReduceScatter op (the effective bias is
            the sum over ranks and moves world_size times as far per optimizer step as the
            single-process model's). A difference from te.ops, whose only layout that is.
        rng_state_tracker_function: te.ops keyword, accepted at its default only
            (NotImplementedError otherwise).

    The decomposition is the C++ ops::Linear's: the basic ops are built there and wrapped here.
    """

    def __init__(
        self,
        in_features,
        out_features,
        *,
        bias=True,
        device=None,
        dtype=None,
        tensor_parallel_mode=None,
        tensor_parallel_group=None,
        sequence_parallel=False,
        rng_state_tracker_function=None,
        accumulate_into_main_grad=False,
        row_parallel_bias="replicated",
    ):
        reject_unsupported(
            "Linear",
            rng_state_tracker_function=(rng_state_tracker_function, None),
        )
        self.in_features, self.out_features = int(in_features), int(out_features)
        tp = tensor_parallel_args(
            "Linear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        cpp = _C.Linear(
            self.in_features,
            self.out_features,
            bool(bias),
            _device(device),
            _dtype(dtype),
            row_parallel_bias=row_parallel_bias,
            **tp,
        )
        basic = _linear_faces(cpp, tensor_parallel_group, accumulate_into_main_grad)
        summand = cpp.collective_op is not None
        self._row_parallel_bias = row_parallel_bias  # as asked (checked in C++)
        self.tensor_parallel_mode = "row" if summand else basic[0].tensor_parallel_mode
        parallel = self.tensor_parallel_mode is not None
        self.tensor_parallel_group = tensor_parallel_group if parallel else None
        self.tensor_parallel_size = tp["group_size"] if parallel else 1
        self.sequence_parallel = bool(sequence_parallel) and parallel
        self._has_bias = bool(bias)
        # Over the faces' C++ ops, which may have adopted new parameters (FP8 weights).
        super().__init__(basic, _cpp=_composite_cpp(basic, self._has_bias))
        if not bias:
            self.register_parameter("bias", None)

    def _rebuild_cpp(self):
        return _composite_cpp(list(self.basic_ops), self._has_bias)

    # te.ops' Linear keeps its parameters under basic_ops.0.weight / basic_ops.1.bias, and an
    # _extra_state per basic op: a te.ops checkpoint loads into this Linear (strict included).
    _TE_KEYS = (("basic_ops.0.weight", "weight"), ("basic_ops.1.bias", "bias"))

    # Read-only after construction: the decomposition is built with it.
    row_parallel_bias = property(lambda self: self._row_parallel_bias)

    # 2: a row-parallel Linear's bias is replicated. Version 1 checkpoints (fusible before it, and
    # te.ops) hold per-rank summands there.
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
        summands = prefix + "basic_ops.1.bias" in state_dict  # te.ops' layout
        summands |= local_metadata.get("version") == 1 and prefix + "bias" in state_dict
        for te_key, key in self._TE_KEYS:
            if prefix + te_key in state_dict and prefix + key not in state_dict:
                state_dict[prefix + key] = state_dict.pop(prefix + te_key)
        if summands and self._replicated_row_bias():
            # te.ops' per-rank summands: the replicated bias is their sum (a collective).
            state_dict[prefix + "bias"] = sum_over_group(
                state_dict[prefix + "bias"], self.tensor_parallel_group, self.bias.device
            )
        for i in range(3):  # te.ops' Linear has up to three basic ops (row: + the reduction)
            drop_empty_te_extra_state(state_dict, f"{prefix}basic_ops.{i}._extra_state")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)

    def _replicated_row_bias(self):
        return (
            self._has_bias
            and self.tensor_parallel_mode == "row"
            and self.row_parallel_bias == "replicated"
        )

    def _param_sources(self):
        # The Linear's own attributes: what state dicts, functional_call and FSDP address.
        return [(self, name) for name in ("weight", "bias")[: 1 + int(self._has_bias)]]

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def _composite_cpp(basic, has_bias):
    """The C++ Linear over the basic ops' C++ ops (BasicLinear, Bias, collective)."""
    bias = basic[1]._cpp if has_bias else None
    collective = basic[-1]._cpp if len(basic) > 1 + int(has_bias) else None
    return _C.Linear(basic[0]._cpp, bias, collective)


def _linear_faces(cpp, group, accumulate_into_main_grad):
    """Python faces over the basic ops of a C++ ops::Linear, configured as the C++ ones are."""
    lin = cpp.linear_op
    tp = lin.tensor_parallel_args
    mode, size = tp.get("mode"), tp.get("group_size", 1)
    out_features = lin.local_out_features * (size if mode == "column" else 1)
    faces = [
        BasicLinear(
            lin.local_in_features * (size if mode == "row" else 1),
            out_features,
            tensor_parallel_mode=mode,
            tensor_parallel_group=group if mode else None,
            sequence_parallel=tp.get("sequence_parallel", False),
            accumulate_into_main_grad=accumulate_into_main_grad,
            _cpp=lin,
        )
    ]
    if cpp.bias_op is not None:
        faces.append(
            Bias(
                out_features,
                tensor_parallel=mode == "column",
                sequence_parallel=cpp.bias_op.param_grad_reduction is not None,
                tensor_parallel_group=group,
                _cpp=cpp.bias_op,
            )
        )
    if cpp.collective_op is not None:
        reduce = {"AllReduce": AllReduce, "ReduceScatter": ReduceScatter}
        faces.append(reduce[cpp.collective_op.type_name](group, _cpp=cpp.collective_op))
    return faces


def te_ops_state_dict(module):
    """module.state_dict() in te.ops' layout: each Linear's weight / bias under
    basic_ops.0.weight / basic_ops.1.bias (what te.ops' Linear writes); other keys unchanged. A
    row-parallel Linear's replicated bias is written as te.ops' per-rank summands: the bias on
    rank 0, zeros elsewhere (their sum is the bias, exactly)."""
    out = module.state_dict()
    renames = {}
    for name, m in module.named_modules():
        if isinstance(m, Linear):
            prefix = f"{name}." if name else ""
            for te_key, key in Linear._TE_KEYS:
                renames[prefix + key] = prefix + te_key
            if m._replicated_row_bias() and torch.distributed.get_rank(m.tensor_parallel_group):
                out[prefix + "bias"] = torch.zeros_like(out[prefix + "bias"])
    return type(out)((renames.get(k, k), v) for k, v in out.items())

"""The built-in basic operations (API.md's table) and the composite Linear."""

from .. import _C
from ._base import BasicOperation, FusedOperation, _device, _dtype, reject_unsupported


def _normalized_shape(shape):
    return [int(shape)] if isinstance(shape, int) else [int(s) for s in shape]


class Identity(BasicOperation):
    """y = x."""

    def __init__(self):
        super().__init__(_C.Identity())


class Reshape(BasicOperation):
    """y = x.reshape(shape)."""

    def __init__(self, shape):
        self.shape = tuple(int(s) for s in shape)
        super().__init__(_C.Reshape(list(self.shape)))


class ConstantScale(BasicOperation):
    """y = scale * x."""

    def __init__(self, scale):
        self.scale = float(scale)
        super().__init__(_C.ConstantScale(self.scale))


class Bias(BasicOperation):
    """y = x + bias over the last dim; parameter `bias`, zeros."""

    def __init__(
        self, size, *, device=None, dtype=None, tensor_parallel=False, tensor_parallel_group=None
    ):
        reject_unsupported(
            "Bias",
            tensor_parallel=(tensor_parallel, False),
            tensor_parallel_group=(tensor_parallel_group, None),
        )
        super().__init__(_C.Bias(int(size), _device(device), _dtype(dtype)))


class BasicLinear(BasicOperation):
    """y = x W^T; parameter `weight` [out_features, in_features]."""

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
    ):
        reject_unsupported(
            "BasicLinear",
            tensor_parallel_mode=(tensor_parallel_mode, None),
            tensor_parallel_group=(tensor_parallel_group, None),
            sequence_parallel=(sequence_parallel, False),
            rng_state_tracker_function=(rng_state_tracker_function, None),
            accumulate_into_main_grad=(accumulate_into_main_grad, False),
            userbuffers_options=(userbuffers_options, None),
        )
        self.in_features, self.out_features = int(in_features), int(out_features)
        super().__init__(
            _C.BasicLinear(self.in_features, self.out_features, _device(device), _dtype(dtype))
        )


class LayerNorm(BasicOperation):
    """Layer norm over the trailing `normalized_shape` dims; parameters `weight`, `bias`."""

    def __init__(
        self,
        normalized_shape,
        *,
        eps=1e-5,
        device=None,
        dtype=None,
        zero_centered_gamma=False,
        sm_margin=0,
    ):
        reject_unsupported("LayerNorm", sm_margin=(sm_margin, 0))
        self.normalized_shape = tuple(_normalized_shape(normalized_shape))
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        super().__init__(
            _C.LayerNorm(
                list(self.normalized_shape),
                self.eps,
                _device(device),
                _dtype(dtype),
                self.zero_centered_gamma,
            )
        )


class RMSNorm(BasicOperation):
    """x * rsqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims."""

    def __init__(
        self,
        normalized_shape,
        *,
        eps=1e-5,
        device=None,
        dtype=None,
        zero_centered_gamma=False,
        sm_margin=0,
    ):
        reject_unsupported("RMSNorm", sm_margin=(sm_margin, 0))
        self.normalized_shape = tuple(_normalized_shape(normalized_shape))
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        super().__init__(
            _C.RMSNorm(
                list(self.normalized_shape),
                self.eps,
                _device(device),
                _dtype(dtype),
                self.zero_centered_gamma,
            )
        )


class L2Normalization(BasicOperation):
    """x * rsqrt(sum(x^2) + eps) over the last dim."""

    def __init__(self, *, eps=1e-6, seq_length=None, micro_batch_size=None):
        reject_unsupported(
            "L2Normalization",
            seq_length=(seq_length, None),
            micro_batch_size=(micro_batch_size, None),
        )
        self.eps = float(eps)
        super().__init__(_C.L2Normalization(self.eps))


def _activation(name, kind, gated):
    cpp_cls = _C.GatedActivation if gated else _C.ElementwiseActivation

    def __init__(self, *, cache_quantized_input=False):
        reject_unsupported(name, cache_quantized_input=(cache_quantized_input, False))
        BasicOperation.__init__(self, cpp_cls(name, kind))

    doc = (
        f"y = {kind}(x)" if not gated else f"[a, b] = x halves; y = {kind[:-2] or 'sigmoid'}(a) * b"
    )
    return type(name, (BasicOperation,), {"__init__": __init__, "__doc__": doc})


GELU = _activation("GELU", "gelu", False)
QGELU = _activation("QGELU", "qgelu", False)
ReLU = _activation("ReLU", "relu", False)
SReLU = _activation("SReLU", "srelu", False)
SiLU = _activation("SiLU", "silu", False)
GLU = _activation("GLU", "glu", True)
GEGLU = _activation("GEGLU", "geglu", True)
QGEGLU = _activation("QGEGLU", "qgeglu", True)
ReGLU = _activation("ReGLU", "reglu", True)
SReGLU = _activation("SReGLU", "sreglu", True)
SwiGLU = _activation("SwiGLU", "swiglu", True)


class ClampedSwiGLU(BasicOperation):
    """GPT-OSS SwiGLU with clamped inputs."""

    def __init__(self, *, limit=7.0, alpha=1.702, cache_quantized_input=False):
        reject_unsupported("ClampedSwiGLU", cache_quantized_input=(cache_quantized_input, False))
        self.limit, self.alpha = float(limit), float(alpha)
        super().__init__(_C.ClampedSwiGLU(self.limit, self.alpha))


class ScaledSwiGLU(BasicOperation):
    """y = scales[..., None] * swiglu(x); scales is extra input 0."""

    def __init__(self):
        super().__init__(_C.ScaledSwiGLU())


class AddExtraInput(BasicOperation):
    """y = x + extra (extra input 0)."""

    def __init__(self, *, in_place=False):
        self.in_place = bool(in_place)
        super().__init__(_C.AddExtraInput(self.in_place))


class MakeExtraOutput(BasicOperation):
    """y = x, extra output 0 = x."""

    def __init__(self, *, in_place=False):
        self.in_place = bool(in_place)
        super().__init__(_C.MakeExtraOutput(self.in_place))


class Dropout(BasicOperation):
    """Dropout in training mode, identity in eval mode."""

    def __init__(self, p):
        self.p = float(p)
        super().__init__(_C.Dropout(self.p))


class Linear(FusedOperation):
    """Composite BasicLinear + Bias; `weight`/`bias` are the basic ops' own Parameters."""

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
    ):
        reject_unsupported(
            "Linear",
            tensor_parallel_mode=(tensor_parallel_mode, None),
            tensor_parallel_group=(tensor_parallel_group, None),
            sequence_parallel=(sequence_parallel, False),
            rng_state_tracker_function=(rng_state_tracker_function, None),
            accumulate_into_main_grad=(accumulate_into_main_grad, False),
        )
        self.in_features, self.out_features = int(in_features), int(out_features)
        cpp = _C.Linear(
            self.in_features, self.out_features, bool(bias), _device(device), _dtype(dtype)
        )
        basic = [_wrap_basic(BasicLinear, cpp.get_basic_ops()[0])]
        if bias:
            basic.append(_wrap_basic(Bias, cpp.get_basic_ops()[1]))
        super().__init__(basic, _cpp=cpp)
        if not bias:
            self.register_parameter("bias", None)


def _wrap_basic(cls, cpp_op):
    """A Python face for a basic op that a C++ composite already built."""
    op = cls.__new__(cls)
    BasicOperation.__init__(op, cpp_op)
    return op

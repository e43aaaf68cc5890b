"""LayerNorm, RMSNorm and L2Normalization (csrc/ops/basic/norms)."""

from ... import _C
from .._args import as_shape, device_arg, dtype_arg, reject_unsupported
from .._distributed import grad_reduction_spec, with_grad_reduction
from ..op import BasicOperation
from ._faces import arg, as_float, make_face


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
        # te.ops takes an int or {"forward": .., "backward": .., "inference": ..}; 0 is what runs.
        margins = sm_margin.values() if isinstance(sm_margin, dict) else [sm_margin]
        for margin in margins:
            reject_unsupported(type(self).__name__, sm_margin=(margin, 0))
        self.normalized_shape = as_shape(normalized_shape, type(self).__name__)
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self._grad_reduction = grad_reduction_spec(
            type(self).__name__, sequence_parallel, tensor_parallel_group
        )
        self._sequence_parallel = self._grad_reduction is not None
        self.tensor_parallel_group = tensor_parallel_group if self._sequence_parallel else None
        super().__init__(self._make_cpp(device_arg(device), dtype_arg(dtype)))

    def _make_cpp(self, device, dtype):
        cpp = type(self)._cpp_class(
            list(self.normalized_shape), self.eps, device, dtype, self.zero_centered_gamma
        )
        return with_grad_reduction(cpp, self._grad_reduction)


class LayerNorm(_Norm):
    """Layer norm over the trailing `normalized_shape` dims; parameters `weight` (ones, or zeros
    with zero_centered_gamma, which applies 1 + weight) and `bias` (zeros). Computed in autocast's
    dtype, else the parameters'; a float32 input beside a bf16 or fp16 one is read as it is
    (rounded on load, as a cast would) and its gradient comes back in float32, rounded once.

    Args:
        normalized_shape (int or tuple): the trailing dims normalized over.
        eps (float): added to the variance.
        device, dtype: of the parameters (None: the active torch.device context, else the current
            CUDA device when there is one, else the CPU; "meta" defers allocation).
        zero_centered_gamma (bool): store the scale minus one.
        sm_margin (int or dict): te.ops keyword (SMs left free for other kernels), accepted
            at 0 only, also as a dict of 0s (NotImplementedError otherwise).
        sequence_parallel (bool), tensor_parallel_group: the rows of x are sharded over the group
            (None: the default group) and the parameters replicated: the backward sums their
            gradients over it, so every replica takes the single-process model's step (an
            extension of te.ops, where Megatron-LM sums them outside the op).
    """

    _cpp_class = _C.LayerNorm


class RMSNorm(_Norm):
    """y = x * rsqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims, in the
    dtypes LayerNorm's are.

    Args:
        normalized_shape (int or tuple): the trailing dims normalized over.
        eps (float): added to the mean square.
        device, dtype: of the parameter (as LayerNorm's).
        zero_centered_gamma (bool): store the scale minus one.
        sm_margin (int or dict): te.ops keyword (SMs left free for other kernels), accepted
            at 0 only, also as a dict of 0s (NotImplementedError otherwise).
        sequence_parallel (bool), tensor_parallel_group: as LayerNorm's.
    """

    _cpp_class = _C.RMSNorm


L2Normalization = make_face(
    "L2Normalization",
    """y = x * rsqrt(sum(x^2) + eps) over the last dim.

    Args:
        eps (float): added to the sum of squares.
        seq_length, micro_batch_size: te.ops keywords, the sizes te.ops warms its JIT kernels
            up for; they change no result, and fusible has no JIT warm-up (kept as given).
    """,
    [
        arg("eps", 1e-6, as_float),
        arg("seq_length", None),
        arg("micro_batch_size", None),
    ],
    cpp_args=["eps"],
    repr_fields=["eps"],
    module=__name__,
)

__all__ = ["L2Normalization", "LayerNorm", "RMSNorm"]

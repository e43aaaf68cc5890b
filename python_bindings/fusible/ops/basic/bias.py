"""Bias: y = x + bias over the last dim (csrc/ops/basic/bias)."""

from ... import _C
from .._args import device_arg, dtype_arg, size_arg
from .._distributed import grad_reduction_spec, group_spec, with_grad_reduction
from ..op import BasicOperation


class Bias(BasicOperation):
    """y = x + bias over the last dim; parameter `bias` [size], initialized to zeros.

    Args:
        size (int): length of the last dim.
        device: where the parameter lives (None: the active torch.device context, else the
            current CUDA device when there is one, else the CPU; "meta" defers allocation).
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
        self.size = size_arg("Bias", "size", size)
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
            _cpp = self._make_cpp(device_arg(device), dtype_arg(dtype))
        super().__init__(_cpp)

    def _make_cpp(self, device, dtype):
        return with_grad_reduction(_C.Bias(self.local_size, device, dtype), self._grad_reduction)

    def _sharded_entries(self, prefix, state):
        if self.tensor_parallel and prefix + "bias" in state:
            yield prefix + "bias", 0, self.tensor_parallel_group


__all__ = ["Bias"]

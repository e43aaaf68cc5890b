"""te.ops' collective ops along dim 0 (AllGather, ReduceScatter, AllReduce) over a
torch.distributed process group (csrc/ops/basic/collectives)."""

from ... import _C
from .._distributed import group_spec
from ..op import BasicOperation


class _Collective(BasicOperation):
    _repr_fields = ()
    _cpp_class = None

    def __init__(self, process_group=None, *, _cpp=None):
        self.process_group = process_group
        self.process_group_size = group_spec(type(self).__name__, process_group)[1]
        super().__init__(_cpp if _cpp is not None else self._make_cpp(None, None))

    def _make_cpp(self, device, dtype):
        return getattr(_C, type(self).__name__)(
            *group_spec(type(self).__name__, self.process_group)
        )


class AllGather(_Collective):
    """Gathers x from every rank of `process_group` (None: the default group) along dim 0, in rank
    order; the backward reduce-scatters the gradient (its adjoint)."""


class ReduceScatter(_Collective):
    """Sums x over the ranks of `process_group` and keeps this rank's slice of dim 0 (which the
    group size must divide); the backward all-gathers the gradient."""


class AllReduce(_Collective):
    """Sums x over the ranks of `process_group`; the backward passes the gradient through (it is
    the same on every rank), as te.ops' AllReduce.

    Args:
        process_group: the group (None: the default group).
        reduce_in_backward (bool): te.ops' keyword, kept as `_reduce_in_backward`: te.ops'
            AllReduce passes the gradient through whatever its value, and so does this one.
    """

    def __init__(self, process_group=None, reduce_in_backward=True, *, _cpp=None):
        self._reduce_in_backward = bool(reduce_in_backward)
        super().__init__(process_group, _cpp=_cpp)


__all__ = ["AllGather", "AllReduce", "ReduceScatter"]

"""te.ops' `ops.fuser` module: OperationFuser, the Python face of the C++ fuser, and the
registration of fusion functions (fusion_registry)."""

from torch import _disable_dynamo

from .. import _C
from . import fused
from ._call import (
    PreForwardHooks,
    call_parameters,
    check_tensors,
    run_with_op_kwargs,
    split_outputs,
    unpack_outputs,
)
from .fusion_registry import (
    register_backward_fusion,
    register_forward_backward_fusion,
    register_forward_fusion,
    restore_fusions,
    snapshot_fusions,
    unregister_fusion,
)
from .op import FusibleOperation

__all__ = [
    "OperationFuser",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
    "restore_fusions",
    "snapshot_fusions",
    "unregister_fusion",
]


def basic_wrappers(ops):
    """The Python basic ops behind a list of Python ops, in forward order."""
    out = []
    for op in ops:
        out.extend(op._basic_op_list())
    return out


class OperationFuser:
    """A callable fuser over a list of fusible ops: plans fusions and runs the whole list forward
    and backward in one autograd node. While alive it holds its ops' channel routing.

    Args:
        ops: a list of fusible ops (composites such as Linear expand into their basic ops).
    """

    def __init__(self, ops):
        ops = list(ops)
        for op in ops:
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"OperationFuser: expected fusible ops, got {type(op).__name__}")
        self._attach(_C.OperationFuser([op._cpp for op in ops], True), ops)

    @classmethod
    def _view(cls, cpp_fuser, ops):
        """The Python face of a fuser group that a C++ Sequential made."""
        self = cls.__new__(cls)
        self._attach(cpp_fuser, ops)
        return self

    def _attach(self, cpp_fuser, ops):
        self._ops = ops
        self._basic = basic_wrappers(ops)
        self._cpp = cpp_fuser
        self._pre_hooks = PreForwardHooks(self._basic)
        self._exported = cpp_fuser.exported()
        # Where each parameter of a call is read from, in the C++ fuser's order.
        self._param_sources = [src for op in ops for src in op._param_sources()]
        if len(self._param_sources) != sum(cpp_fuser.parameter_counts):
            raise RuntimeError(
                f"OperationFuser: the ops report {len(self._param_sources)} parameters but their "
                f"C++ operations take {sum(cpp_fuser.parameter_counts)}"
            )

    def __getstate__(self):
        return {"ops": self._ops}

    def __setstate__(self, state):
        self.__init__(state["ops"])

    @property
    def num_extra_inputs(self):
        """How many public extra inputs a call takes."""
        return self._cpp.num_extra_inputs

    @property
    def num_extra_outputs(self):
        """How many public extra outputs a call returns after y."""
        return self._cpp.num_extra_outputs

    @_disable_dynamo
    def __call__(self, input, *extra_inputs, basic_op_kwargs=None):
        """`y = fuser(x, *extra_inputs)`; with public extra outputs, `(y, *extra_outputs)`.
        basic_op_kwargs: one dict of op_forward keywords per basic op (te.ops)."""
        check_tensors("OperationFuser", input, extra_inputs)
        self._pre_hooks(input, extra_inputs)
        params = call_parameters(self._param_sources)

        def run():
            return self._cpp.forward(input, list(extra_inputs), [], params)

        out = (
            run()
            if basic_op_kwargs is None
            else run_with_op_kwargs(self._basic, basic_op_kwargs, run)
        )
        return unpack_outputs(split_outputs(out, self._exported)[0])

    def extra_input_sources(self):
        """Per basic op, per extra-input slot: the (producer basic op, slot) feeding it, or None."""
        return self._cpp.extra_input_sources()

    def _py_op(self, cpp_op, indices):
        if not cpp_op.is_fused and len(indices) == 1:
            return self._basic[indices[0]]
        if isinstance(cpp_op, _C.PyFusedOperation):
            return cpp_op.python_object
        # A built-in fused op made by a fusion: a module over the user's own basic ops.
        return getattr(fused, cpp_op.type_name)._from_plan(
            cpp_op, [self._basic[i] for i in indices]
        )

    def forward_ops(self):
        """The most recent forward plan: [(op, [basic-op indices])], in forward order."""
        return [(self._py_op(op, idx), list(idx)) for op, idx in self._cpp.forward_ops()]

    def backward_ops(self):
        """The most recent backward plan: [(op, [basic-op indices])], in forward order."""
        return [(self._py_op(op, idx), list(idx)) for op, idx in self._cpp.backward_ops()]

    def fusion_plan(self):
        """[{"forward": [op type names], "backward": [...]}] of the most recent forward."""
        forward, backward = self._cpp.fusion_plan()
        return [{"forward": list(forward), "backward": list(backward)}]

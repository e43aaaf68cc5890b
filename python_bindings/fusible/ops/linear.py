"""te.ops' `ops.linear` module: the composite Linear (BasicLinear + Bias, and the reduction of a
row-parallel layout), built in C++ (ops::Linear) and wrapped here over Python faces of its basic
ops."""

import weakref

import torch

from .. import _C
from ._args import device_arg, dtype_arg, reject_unsupported, size_arg
from ._distributed import sum_over_group, tensor_parallel_args
from .basic.basic_linear import BasicLinear, sharded_weight
from .basic.bias import Bias
from .basic.collectives import AllReduce, ReduceScatter
from .op import FusedOperation, drop_empty_te_extra_state

__all__ = ["Linear"]


class Linear(FusedOperation):
    """y = x W^T + b: the composite BasicLinear + Bias. `weight` and `bias` are the basic ops' own
    Parameters, under torch.nn.Linear's state-dict keys.

    Args:
        in_features (int), out_features (int): sizes of x's and y's last dim.
        bias (bool): add a learnable bias.
        device, dtype: of the parameters (None: as Bias's; "meta" defers allocation).
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
        self.in_features = size_arg("Linear", "in_features", in_features)
        self.out_features = size_arg("Linear", "out_features", out_features)
        tp = tensor_parallel_args(
            "Linear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        cpp = _C.Linear(
            self.in_features,
            self.out_features,
            bool(bias),
            device_arg(device),
            dtype_arg(dtype),
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
        self._link_basic_ops()

    def _link_basic_ops(self):
        # A parameter assigned to a basic op (lin.basic_ops[0].weight = p, te.ops' route) is
        # assigned to this Linear too, which computes with it.
        for op in self.basic_ops:
            owner = op.__dict__.get("_owner")
            if owner is None or owner() is None:  # a shallow copy shares its original's ops
                op.__dict__["_owner"] = weakref.ref(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link_basic_ops()

    def _rebuild_cpp(self):
        return _composite_cpp(list(self.basic_ops), self._has_bias)

    # te.ops' Linear keeps its parameters under basic_ops.0.weight / basic_ops.1.bias, and an
    # _extra_state per basic op: a te.ops checkpoint loads into this Linear (strict included).
    _TE_KEYS = (("basic_ops.0.weight", "weight"), ("basic_ops.1.bias", "bias"))

    # Read-only after construction: the decomposition is built with it.
    row_parallel_bias = property(lambda self: self._row_parallel_bias)

    # 2: a row-parallel Linear's bias is replicated (since before fusible 0.1.0; te.ops' per-rank
    # summands are recognized by te.ops' keys).
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
        # te.ops' layout, by its keys. (torch.nn.Module's default version, 1, says nothing: a
        # torch.nn.Linear's or Megatron's state dict has it with one replicated bias.)
        summands = prefix + "basic_ops.1.bias" in state_dict
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

    def _sharded_entries(self, prefix, state):
        yield from sharded_weight(self, prefix, state)
        column = self.tensor_parallel_mode == "column"
        summand = self.row_parallel_bias == "summand" and self.tensor_parallel_mode == "row"
        if state.get(prefix + "bias") is not None and (column or summand):
            yield prefix + "bias", 0 if column else None, self.tensor_parallel_group

    def _te_ops_renames(self, prefix, state):
        # A replicated row-parallel bias as te.ops' per-rank summands: the bias on rank 0, zeros
        # elsewhere (their sum is the bias, exactly).
        if self._replicated_row_bias() and torch.distributed.get_rank(self.tensor_parallel_group):
            state[prefix + "bias"] = torch.zeros_like(state[prefix + "bias"])
        return {prefix + key: prefix + te_key for te_key, key in self._TE_KEYS}

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

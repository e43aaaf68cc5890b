"""BasicLinear: y = x W^T, with te.ops' tensor parallelism (csrc/ops/basic/basic_linear)."""

from ... import _C, quantization
from .. import _fp8_weights, _main_grad
from .._args import device_arg, dtype_arg, reject_unsupported, size_arg
from .._distributed import tensor_parallel_args
from ..op import BasicOperation


class BasicLinear(BasicOperation):
    """y = x W^T; parameter `weight` [out_features, in_features], kaiming-uniform like
    torch.nn.Linear.

    Args:
        in_features (int), out_features (int): sizes of x's and y's last dim.
        device: where the weight lives (None: as Bias's; "meta" defers allocation).
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
            reduce-scattered after it. Without tensor parallelism it changes nothing (one rank's
            sequence) and reads False, as in te.ops.
        accumulate_into_main_grad (bool): the backward adds the weight gradient into
            `weight.main_grad` (Megatron's buffer; RuntimeError when missing) instead of
            `weight.grad`, or overwrites it where `weight.overwrite_main_grad` is set; autograd
            then gets a dummy gradient where the weight has `grad_added_to_main_grad` (set to
            True; zeros where `weight.zero_out_wgrad`), else none (te.ops' convention). The
            wgrad GEMM adds into main_grad itself: an fp32 main_grad accumulates the bf16 or FP8
            product in fp32, with no rounding to the compute dtype between (as te's).
        rng_state_tracker_function, userbuffers_options: te.ops
            keywords, accepted at their defaults only (NotImplementedError otherwise).
    """

    supports_float8_block_scaling = True

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
        self.in_features = size_arg("BasicLinear", "in_features", in_features)
        self.out_features = size_arg("BasicLinear", "out_features", out_features)
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._tp_args = tensor_parallel_args(
            "BasicLinear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        if _cpp is None:  # else: made by a composite (Linear), configured as these keywords say
            _cpp = self._make_cpp(device_arg(device), dtype_arg(dtype))
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
        _fp8_weights.register(self, quantization.model_init_weights())

    def _make_cpp(self, device, dtype):
        cpp = _C.BasicLinear(self.in_features, self.out_features, device, dtype, **self._tp_args)
        if self.accumulate_into_main_grad:
            self._set_main_grad_hook(cpp)
        return cpp

    def _set_main_grad_hook(self, cpp):
        _main_grad.set_linear_hook(cpp, self)

    def _sharded_entries(self, prefix, state):
        return sharded_weight(self, prefix, state)


def sharded_weight(op, prefix, state):
    """The (key, dim, group) entry of a tensor-parallel linear's weight in state, if any: rows
    split (dim 0) in column mode, columns (dim 1) in row mode."""
    if op.tensor_parallel_mode is None or prefix + "weight" not in state:
        return []
    dim = 0 if op.tensor_parallel_mode == "column" else 1
    return [(prefix + "weight", dim, op.tensor_parallel_group)]


__all__ = ["BasicLinear"]

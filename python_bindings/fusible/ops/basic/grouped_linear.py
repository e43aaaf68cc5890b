"""GroupedLinear: one linear per group of rows (csrc/ops/basic/grouped_linear)."""

import operator

from ... import _C, quantization
from .. import _fp8_weights, _main_grad
from .._args import device_arg, dtype_arg, reject_unsupported, size_arg
from ..op import BasicOperation


class GroupedLinear(BasicOperation):
    """The rows of x split into num_groups consecutive groups by split sizes (extra input 0: a 1-D
    int32 or int64 tensor, one non-negative entry per group, summing to x's rows); group g computes
    y_g = x_g W_g^T (+ b_g). Parameters weight0..weight{N-1} [out_features, in_features]
    (kaiming-uniform as torch.nn.Linear), bias0..bias{N-1} [out_features] (zeros).

    Args:
        num_groups (int), in_features (int), out_features (int): as above.
        bias (bool): add a learnable bias per group.
        device, dtype: of the parameters (None: as Bias's; "meta" defers allocation).
        scale_bias (bool): with bias, extra input 1 is a per-row scale [rows] (the router's
            probabilities) and each row adds bias_g * its scale; the scales get a gradient.
        accumulate_into_main_grad (bool): each weight's gradient goes into its `main_grad`, as
            BasicLinear's: each group's wgrad GEMM adds into it in its precision (fp32) where
            the split sizes are on the host anyway (CPU, FP8); 16-bit on CUDA adds the grouped
            GEMM's 16-bit gradients (no host wait, graph-capturable).
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

    supports_float8_block_scaling = True

    _buffer_keywords = ("output", "grad_input")

    def get_quantizer(self, mode, index):
        """te.ops' numbering: forward quantizer 2g is group g's input and 2g + 1 its weight;
        backward quantizer g is group g's gradient."""
        index = operator.index(index)  # numpy and torch integers too
        if mode == "forward" and 0 <= index < 2 * self.num_groups:
            index = index // 2 + (self.num_groups if index % 2 else 0)  # the C++ op's order
        return super().get_quantizer(mode, index)

    def extra_repr(self):
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )

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
        self.num_groups = size_arg("GroupedLinear", "num_groups", num_groups)
        self.in_features = size_arg("GroupedLinear", "in_features", in_features)
        self.out_features = size_arg("GroupedLinear", "out_features", out_features)
        self.use_bias = bool(bias)
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
        super().__init__(self._make_cpp(device_arg(device), dtype_arg(dtype)))
        # Under quantized_model_init: each group's weight in FP8 (its own scale), now or when
        # materialized.
        _fp8_weights.register(self, fp8_weight)

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
            single = self.single_grouped_weight
            name = (lambda i: "weight") if single else (lambda i: f"weight{i}")
            _main_grad.set_grouped_hook(cpp, self, name)
        return cpp


__all__ = ["GroupedLinear"]

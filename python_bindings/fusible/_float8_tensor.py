"""FP8 weights (`fusible.quantized_model_init`): a tensor that stores FP8 data with a per-tensor
scale and behaves as a tensor of its high-precision dtype (TransformerEngine's Float8Tensor).

- A GEMM that casts it to FP8 (fusible::fp8_cast in its format, no margin) takes the stored data
  as it is: the weight is not cast again at each forward.
- Any other op sees the dequantized values.
- An op that writes into it (an optimizer step, `copy_` from load_state_dict, init) computes in
  the high-precision dtype and quantizes the result again, with a new scale from its amax.
"""

import torch
from torch.utils._pytree import tree_map

_ALIASING = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _written(func, args, kwargs):
    """Where func's written arguments are: a position in args, else a keyword name."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(i if i < len(args) else arg.name)
    return out


def _get(args, kwargs, key):
    return args[key] if isinstance(key, int) else kwargs.get(key)


def _items(value):
    return value if isinstance(value, (list, tuple)) else [value]


class Float8Tensor(torch.Tensor):
    """FP8 data [same shape] + scale_inv [1] (fp32), in format "e4m3" or "e5m2", looking like a
    tensor of `dtype`."""

    @staticmethod
    def __new__(cls, data, scale_inv, fmt, dtype, requires_grad=False):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=requires_grad
        )
        t._data, t._scale_inv, t._fp8_format = data, scale_inv, fmt
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, hp, fmt, requires_grad=False):
        data, _, scale_inv = torch.ops.fusible.fp8_cast(hp.detach(), fmt)
        return cls(data, scale_inv, fmt, hp.dtype, requires_grad)

    def dequantize(self):
        return (self._data.to(torch.float32) * self._scale_inv).to(self.dtype)

    def _set_from(self, hp):
        """Quantizes hp (this tensor's shape) into this tensor's own data and scale."""
        data, _, scale_inv = torch.ops.fusible.fp8_cast(hp.detach(), self._fp8_format)
        self._data.copy_(data)
        self._scale_inv.copy_(scale_inv)

    def __repr__(self):
        return (
            f"Float8Tensor(format={self._fp8_format}, dtype={self.dtype}, "
            f"values={self.dequantize()})"
        )

    def __reduce_ex__(self, protocol):
        is_param = isinstance(self, torch.nn.Parameter)
        args = (self._data, self._scale_inv, self._fp8_format, self.dtype)
        return (_rebuild, (*args, self.requires_grad, is_param))

    def __deepcopy__(self, memo):
        new = Float8Tensor(
            self._data.clone(), self._scale_inv.clone(), self._fp8_format, self.dtype
        )
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.fusible.fp8_cast.default:
            x, fmt = args[0], args[1]
            margin = args[2] if len(args) > 2 else kwargs.get("margin", 0.0)
            transpose = args[3] if len(args) > 3 else kwargs.get("transpose", False)
            if isinstance(x, Float8Tensor) and fmt == x._fp8_format and margin == 0.0:
                data = x._data
                data_t = (
                    data.reshape(-1, data.shape[-1]).t().contiguous()
                    if transpose
                    else data.new_empty(0)
                )
                return data, data_t, x._scale_inv
        if func in _ALIASING:
            x = args[0]
            return Float8Tensor(x._data, x._scale_inv, x._fp8_format, x.dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, Float8Tensor) else t  # noqa: E731
        hp_args, hp_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        out = func(*hp_args, **hp_kwargs)
        written = _written(func, args, kwargs)
        for key in written:
            for orig, hp in zip(
                _items(_get(args, kwargs, key)), _items(_get(hp_args, hp_kwargs, key))
            ):
                if isinstance(orig, Float8Tensor):
                    orig._set_from(hp)
        if written and func._schema.returns and func._schema.returns[0].alias_info is not None:
            return _get(args, kwargs, written[0])  # an in-place op returns what it wrote
        return out


def _rebuild(data, scale_inv, fmt, dtype, requires_grad=False, is_param=False):
    t = Float8Tensor(data, scale_inv, fmt, dtype)
    return torch.nn.Parameter(t, requires_grad) if is_param else t.requires_grad_(requires_grad)

"""FP8 weights (`fusible.quantized_model_init`): a tensor that stores FP8 data with a per-tensor
scale and behaves as a tensor of its high-precision dtype (TransformerEngine's Float8Tensor).

- A GEMM that casts it to FP8 (fusible::fp8_cast in its format, no margin) takes the stored data
  as it is: the weight is not cast again at each forward.
- Any other op sees the dequantized values.
- `copy_` from a Float8Tensor of the same format and scaling layout (load_state_dict of a saved
  FP8 weight) takes its data and scale as they are, as te's.
- Any other op that writes into it (an optimizer step, a `copy_` from a plain tensor, init)
  computes in the high-precision dtype and quantizes the result again as the recipe says
  (te.ops' rule):
  current scaling with a new scale from the result's amax; delayed scaling with the scale of the
  op's delayed-scaling state (1.0 before its first forward under a DelayedScaling autocast).
- Block scaling (`block_dim` 2): FP8 data with one power-of-two scale per 128x128 tile of the
  weight as [rows, last dim] (cuBLASLt's block-scaled layout), so the GEMMs take the stored data
  and its transpose (the same tiles) as they are; writes quantize each tile from its own amax.
- Under delayed scaling a forward takes the stored data as it is and records the amax of the last
  value written into the op's amax history (as te.ops records a weight's amax when quantizing it).
- Aliases (detach, alias) work under torch.no_grad() and torch.inference_mode().
"""

import torch
from torch.utils._pytree import tree_map

_ALIASING = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_DELAYED_CASTS = (
    torch.ops.fusible.fp8_cast_delayed.default,
    torch.ops.fusible.fp8_quantize_dequantize_delayed.default,
)
_BLOCK_CASTS = (
    torch.ops.fusible.fp8_cast_block.default,
    torch.ops.fusible.fp8_quantize_dequantize_block.default,
)
_TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_TILE = 128  # a block-scaled weight's tiles are _TILE x _TILE


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
    """FP8 data [same shape] + scale_inv (fp32: [1], or per 128x128 tile with block_dim 2, in
    fusible::fp8_cast_block's layout), in format "e4m3" or "e5m2", looking like a tensor of
    `dtype`. `delayed`: written with a delayed-scaling state's scale (see the module's docstring)
    instead of a fresh amax."""

    @staticmethod
    def __new__(
        cls,
        data,
        scale_inv,
        fmt,
        dtype,
        requires_grad=False,
        delayed=None,
        block_dim=None,
        view=False,
    ):
        # Made outside inference mode, so that autograd may give an alias of it a version counter
        # (detach under torch.inference_mode() failed on an inference tensor otherwise). The
        # strides are the data's: a view (t(), a slice) reports its own.
        with torch.inference_mode(False):
            t = torch.Tensor._make_wrapper_subclass(
                cls,
                data.shape,
                strides=data.stride(),
                storage_offset=data.storage_offset(),
                dtype=dtype,
                device=data.device,
                requires_grad=requires_grad,
            )
        t._data, t._scale_inv, t._fp8_format = data, scale_inv, fmt
        # A view shares its base's scale: writes into it quantize with that scale, which they
        # leave as it is (a new scale from part of the values would misread the rest).
        t._view = view
        # Delayed scaling: [the state's live scale [1] (None before the first forward), the amax
        # of the last value written [1]], shared by every alias of this tensor.
        t._delayed = delayed
        t._block_dim = block_dim
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def quantize(cls, hp, fmt, requires_grad=False, delayed=False, block_dim=None):
        """hp in FP8: with a fresh amax's scale, with delayed scaling's initial scale 1.0, or per
        128x128 tile (block_dim 2)."""
        if block_dim is not None:
            data, scale_inv = _cast_tiles(hp, fmt)
            return cls(data, scale_inv, fmt, hp.dtype, requires_grad, block_dim=block_dim)
        if not delayed:
            data, _, scale_inv = torch.ops.fusible.fp8_cast(hp.detach(), fmt)
            return cls(data, scale_inv, fmt, hp.dtype, requires_grad)
        one = torch.ones(1, dtype=torch.float32, device=hp.device)
        t = cls(
            torch.empty_like(hp, dtype=_TORCH_FP8[fmt]),
            one.clone(),
            fmt,
            hp.dtype,
            requires_grad,
            delayed=[None, torch.zeros_like(one)],
        )
        t._set_from(hp)
        return t

    def dequantize(self, *, dtype=None):
        """The stored values as a plain tensor of `dtype` (None: this tensor's high-precision
        dtype). Differentiable, as te's: a loss computed from it gives this tensor a gradient."""
        return _Dequantize.apply(self, self.dtype if dtype is None else dtype)

    def _values(self):
        """dequantize() below autograd (inside __torch_dispatch__)."""
        if self._block_dim is None:
            return (self._data.to(torch.float32) * self._scale_inv).to(self.dtype)
        rows, cols = _rows_cols(self._data)
        tiles = self._scale_inv[:, : -(-cols // _TILE)]
        scale = tiles.repeat_interleave(_TILE, 0)[:rows].repeat_interleave(_TILE, 1)[:, :cols]
        data = self._data.reshape(rows, cols).to(torch.float32)
        return (data * scale).reshape(self.shape).to(self.dtype)

    def _set_from(self, hp):
        """Quantizes hp (this tensor's shape) into this tensor's own data and scale."""
        hp = hp.detach()
        if self._view:
            self._data.copy_(cast_with_scale(hp, self._fp8_format, self._scale_inv.reciprocal()))
            return
        if self._block_dim is not None:
            data, scale_inv = _cast_tiles(hp, self._fp8_format)
        elif self._delayed is None:
            data, _, scale_inv = torch.ops.fusible.fp8_cast(hp, self._fp8_format)
        else:
            scale, amax = self._delayed
            scale = torch.ones_like(amax) if scale is None else scale.to(amax.device)
            data = cast_with_scale(hp, self._fp8_format, scale)
            scale_inv = scale.reciprocal()
            amax.copy_(torch.ops.fusible.fp8_amax(hp))
        self._data.copy_(data)
        self._scale_inv.copy_(scale_inv)

    def _delayed_forward(self, func, args, kwargs):
        """A delayed-scaling cast of this weight in a forward: the stored data as it is; the state
        (args[2:4], live) records the amax of the last write and updates its scale, which the next
        write uses."""
        fmt = args[1]
        history, scale = args[2], args[3]
        rest = list(args[4:])
        # The state's update, as for any cast, from the amax [1] (fp32) of the last write.
        func(self._delayed[1], fmt, history, scale, *rest, **kwargs)
        self._delayed[0] = scale
        if func is torch.ops.fusible.fp8_quantize_dequantize_delayed.default:
            return self._values()
        transpose = args[6] if len(args) > 6 else kwargs.get("transpose", False)
        return self._cast_outputs(transpose)

    def _block_forward(self, func, args, kwargs):
        """A block-scaled cast of this weight in 128x128 tiles: the stored data (and its transpose:
        the same tiles, so the same scales, transposed) as they are."""
        if func is torch.ops.fusible.fp8_quantize_dequantize_block.default:
            return self._values()
        rowwise = args[3] if len(args) > 3 else kwargs.get("rowwise", True)
        columnwise = args[4] if len(args) > 4 else kwargs.get("columnwise", False)
        none = self._data.new_empty(0)
        no_scale = self._scale_inv.new_empty(0)
        rows, cols = _rows_cols(self._data)
        data_t, scale_inv_t = none, no_scale
        if columnwise:
            data_t = self._data.reshape(rows, cols).t().contiguous()
            row_tiles, col_tiles = -(-rows // _TILE), -(-cols // _TILE)
            scale_inv_t = self._scale_inv.new_zeros(col_tiles, -(-row_tiles // 4) * 4)
            scale_inv_t[:, :row_tiles] = self._scale_inv[:, :col_tiles].t()
        if not rowwise:
            return none, no_scale, data_t, scale_inv_t
        return self._data, self._scale_inv, data_t, scale_inv_t

    def _copy_bytes(self, src):
        """copy_ from a Float8Tensor of this one's layout (load_state_dict): its data and scale as
        they are (te's rule), so a loaded FP8 weight equals the saved one bit for bit."""
        self._data.copy_(src._data)
        self._scale_inv.copy_(src._scale_inv)
        if self._delayed is not None:  # the amax of the last value written, as the source's
            if src._delayed is not None:
                amax = src._delayed[1]
            else:
                amax = torch.ops.fusible.fp8_amax(src._values())
            self._delayed[1].copy_(amax.float().reshape(1))
        return self

    def _cast_outputs(self, transpose):
        """(data, its [K, M] transpose or empty, scale_inv) as fp8_cast returns them."""
        data = self._data
        data_t = (
            data.reshape(-1, data.shape[-1]).t().contiguous() if transpose else data.new_empty(0)
        )
        return data, data_t, self._scale_inv

    def __repr__(self):
        return (
            f"Float8Tensor(format={self._fp8_format}, dtype={self.dtype}, "
            f"values={self._values()})"
        )

    def _delayed_copy(self):
        """The delayed-scaling record as a copy holds it: the scale's value (its own op's state
        takes over at the copy's first forward)."""
        if self._delayed is None:
            return None
        scale, amax = self._delayed
        return [None if scale is None else scale.detach().clone(), amax.clone()]

    def __reduce_ex__(self, protocol):
        is_param = isinstance(self, torch.nn.Parameter)
        args = (self._data, self._scale_inv, self._fp8_format, self.dtype)
        extra = (self._delayed_copy(), self._block_dim)
        return (_rebuild, (*args, self.requires_grad, is_param, *extra))

    def __deepcopy__(self, memo):
        new = Float8Tensor(
            self._data.clone(),
            self._scale_inv.clone(),
            self._fp8_format,
            self.dtype,
            delayed=self._delayed_copy(),
            block_dim=self._block_dim,
        )
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=self.requires_grad)
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.fusible.fp8_quantize_dequantize.default:
            x, fmt = args[0], args[1]
            margin = args[2] if len(args) > 2 else kwargs.get("margin", 0.0)
            if _is_per_tensor(x) and fmt == x._fp8_format and margin == 0.0:
                return x._values()  # already on the grid of this cast (CPU emulation)
        if func is torch.ops.fusible.fp8_cast.default:
            x, fmt = args[0], args[1]
            margin = args[2] if len(args) > 2 else kwargs.get("margin", 0.0)
            transpose = args[3] if len(args) > 3 else kwargs.get("transpose", False)
            if _is_per_tensor(x) and fmt == x._fp8_format and margin == 0.0:
                return x._cast_outputs(transpose)
        if func in _BLOCK_CASTS:
            x = args[0]
            if isinstance(x, Float8Tensor) and x._block_dim == args[2] and args[1] == x._fp8_format:
                return x._block_forward(func, args, kwargs)
        if func in _DELAYED_CASTS:
            x = args[0]
            if isinstance(x, Float8Tensor) and x._delayed is not None and args[1] == x._fp8_format:
                return x._delayed_forward(func, args, kwargs)
        if func is torch.ops.aten.copy_.default and _copies_bytes(args[0], args[1]):
            return args[0]._copy_bytes(args[1])
        if func in _ALIASING:
            x = args[0]
            return Float8Tensor(
                x._data,
                x._scale_inv,
                x._fp8_format,
                x.dtype,
                delayed=x._delayed,
                block_dim=x._block_dim,
                view=x._view,
            )
        if _is_view(func) and isinstance(args[0], Float8Tensor) and args[0]._block_dim is None:
            # A view of the FP8 data with the same scale (a dequantized copy would not be a view,
            # and autograd cannot make an inference-mode copy one).
            x = args[0]
            out = func(x._data, *args[1:], **kwargs)
            wrap = lambda d: Float8Tensor(  # noqa: E731
                d, x._scale_inv, x._fp8_format, x.dtype, delayed=x._delayed, view=True
            )
            return [wrap(d) for d in out] if isinstance(out, (list, tuple)) else wrap(out)
        unwrap = lambda t: t._values() if isinstance(t, Float8Tensor) else t  # noqa: E731
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


class _Dequantize(torch.autograd.Function):
    """Float8Tensor.dequantize: the gradient passes through to the Float8Tensor, in its dtype."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = t.dtype
        return t._values().to(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def _copies_bytes(dst, src):
    """Whether dst.copy_(src) takes src's FP8 data and scale as they are: both Float8Tensors of
    one format, shape and scaling layout, dst not a view of another tensor's data."""
    return (
        isinstance(dst, Float8Tensor)
        and isinstance(src, Float8Tensor)
        and not dst._view
        and dst._fp8_format == src._fp8_format
        and dst._block_dim == src._block_dim
        and dst.shape == src.shape
        and dst._scale_inv.shape == src._scale_inv.shape
    )


def _is_per_tensor(x):
    """Whether x is a Float8Tensor with one scale: a per-tensor cast of it in its format takes its
    data and scale as they are, however the scale was chosen."""
    return isinstance(x, Float8Tensor) and x._block_dim is None


def _is_view(func):
    """Whether func returns views of its first argument without writing (view, t, transpose,
    reshape as a view, split, ...); a view that changes the dtype is not one of these."""
    schema = func._schema
    if func is torch.ops.aten.view.dtype or not schema.returns or not schema.arguments:
        return False
    ret, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and not ret.is_write and first is not None and not first.is_write


def cast_with_scale(hp, fmt, scale):
    """hp cast to FP8 format fmt with a given scale [1] (saturating): delayed scaling's cast, and
    a write that keeps a tensor's scale."""
    fp8 = _TORCH_FP8[fmt]
    limit = torch.finfo(fp8).max
    return (hp.float() * scale).clamp(-limit, limit).to(fp8)


def _rows_cols(t):
    cols = t.shape[-1] if t.dim() else 1
    return (t.numel() // cols if cols else 0), cols


def _cast_tiles(hp, fmt):
    """hp in FP8 per 128x128 tile of [rows, last dim] -> (data in hp's shape, scale_inv)."""
    data, scale_inv, _, _ = torch.ops.fusible.fp8_cast_block(hp.detach(), fmt, 2, True, False)
    return data, scale_inv


def _rebuild(
    data, scale_inv, fmt, dtype, requires_grad=False, is_param=False, delayed=None, block_dim=None
):
    t = Float8Tensor(data, scale_inv, fmt, dtype, delayed=delayed, block_dim=block_dim)
    return torch.nn.Parameter(t, requires_grad) if is_param else t.requires_grad_(requires_grad)

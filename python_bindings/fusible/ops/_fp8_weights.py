"""Weights stored in FP8 under fusible.quantized_model_init: quantized once materialized, and
refused in a call while still waiting for it."""

import weakref

import torch

from .._float8_tensor import Float8Tensor

# Ops built on the meta device under quantized_model_init whose weight is not quantized yet.
pending = weakref.WeakSet()


def check_materialized(sources):
    """Raises when a call's (module, attribute) sources include an op whose FP8 weight waits for
    reset_parameters()."""
    for module, _ in sources:
        for op in module._basic_op_list():
            if op in pending:
                raise RuntimeError(
                    f"{type(op).__name__}: its weight was built on the meta device under "
                    "fusible.quantized_model_init and is quantized to FP8 when materialized: call "
                    "reset_parameters() (after to_empty(device=...)) before the first forward"
                )


def register(op, how):
    """Records op's quantized_model_init settings (`how`, or None) and quantizes its weights now,
    or when they are materialized."""
    op._fp8_weight = how
    if how is None:
        return
    if any(op._parameters[n].is_meta for n in op._fp8_weight_names()):
        pending.add(op)
    quantize(op)


def quantize(module):
    """Stores the weight of every basic op of module built under quantized_model_init in FP8
    (a Float8Tensor Parameter), once it is materialized; aliases in module's tree follow."""
    for op in module._basic_op_list():
        how = getattr(op, "_fp8_weight", None)
        if how is None:
            continue
        changed = False
        names = op._fp8_weight_names()
        for weight_name in names:
            w = op._parameters.get(weight_name)
            if w is None or w.is_meta or isinstance(w, Float8Tensor):
                continue
            q = Float8Tensor.quantize(w, how.format, delayed=how.delayed, block_dim=how.block_dim)
            q = torch.nn.Parameter(q, requires_grad=w.requires_grad)
            for m in module.modules():
                for name, p in list(m._parameters.items()):
                    if p is w:
                        m._parameters[name] = q
            changed = True
        if changed or not any(getattr(op._parameters.get(n), "is_meta", False) for n in names):
            pending.discard(op)
        if changed:
            op._sync_cpp_parameters()

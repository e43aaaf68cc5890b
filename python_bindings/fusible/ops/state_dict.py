"""State dicts across layouts: the single-process model's (gathered from tensor-parallel shards and
loaded back into them) and te.ops' (its Linear's keys). Each op says which of its entries are
sharded (`_sharded_entries`) and how te.ops names them (`_te_ops_renames`)."""

import torch

from ._distributed import sum_over_group
from .basic import AddExtraInput, ConstantScale, Dropout, Identity, MakeExtraOutput, Quantize
from .op import FusibleOperation
from .sequential import Sequential

_SEQUENTIALS = (Sequential, torch.nn.Sequential)

# Ops between a column-parallel linear and a GLU that keep the GLU's halves where they are.
_KEEPS_LAYOUT = (AddExtraInput, ConstantScale, Dropout, Identity, MakeExtraOutput, Quantize)


def _split_row_shards(op):
    """Whether op shards rows (dim 0) only: a column-parallel linear, a tensor-parallel bias."""
    entries = list(op._sharded_entries("", op.state_dict(keep_vars=True)))
    return bool(entries) and all(dim == 0 for _, dim, _ in entries)


def _steps(sequential):
    """The steps of a Sequential in order, those of nested Sequentials in their place."""
    for child in sequential.children():
        if isinstance(child, _SEQUENTIALS):
            yield from _steps(child)
        else:
            yield child


def _glu_halves(module):
    """The ops whose row shards feed a GLU that splits each rank's rows into halves [a, b]
    (glu_interleave_size None), in a Sequential (nested ones included). Each rank holds its slice
    of a and its slice of b, so their full tensor is [a; b] and rank r's shard is [a_r; b_r], not
    the r-th contiguous chunk (interleaved GLUs pair rows in blocks, which contiguous chunks keep
    together). What a module's own forward does is not known here."""
    halves = set()
    for m in module.modules():
        if not isinstance(m, _SEQUENTIALS):
            continue
        pending = []
        for step in _steps(m):
            if not isinstance(step, FusibleOperation):
                pending = []
            elif getattr(step, "glu_interleave_size", 0) is None:
                halves.update(id(op) for op in pending)
                pending = []
            elif _split_row_shards(step):
                pending.append(step)
            elif not isinstance(step, _KEEPS_LAYOUT):
                pending = []
    return halves


def _sharded_entries(module, state):
    """(key, dim, group, parts) for every tensor-parallel entry of module's state dict: dim 0 or
    1, the dim the shards split, or None for a per-rank summand (summed, not concatenated); parts:
    how many equal blocks along dim each shard takes its slice of (2 for a GLU's halves)."""
    halves = _glu_halves(module)
    for name, m in module.named_modules():
        if isinstance(m, FusibleOperation):
            parts = 2 if id(m) in halves else 1
            for key, dim, group in m._sharded_entries(f"{name}." if name else "", state):
                yield key, dim, group, parts


def full_state_dict(module):
    """module.state_dict() as the single-process model's: every tensor-parallel shard gathered in
    rank order (column-parallel weights and sharded biases along dim 0, row-parallel weights along
    dim 1) and the per-rank bias summands of a row-parallel Linear built with
    row_parallel_bias="summand" summed (te.ops adds each before the reduction). A collective:
    call it on every rank; every rank gets the whole dict."""
    dist = torch.distributed
    state = module.state_dict()
    for key, dim, group, parts in list(_sharded_entries(module, state)):
        shard = state[key].detach().contiguous()
        if dim is None:
            state[key] = sum_over_group(shard, group)
        else:
            shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, shard, group=group)
            blocks = zip(*(s.chunk(parts, dim) for s in shards))  # block by block, ranks in order
            state[key] = torch.cat([b for block in blocks for b in block], dim)
    return state


def load_full_state_dict(module, full_state, strict=True):
    """Loads full_state, the single-process model's state dict, into this rank's shards of
    module: the inverse of full_state_dict (a per-rank bias summand: the bias on rank 0, zeros
    elsewhere, whose sum is the bias exactly). Needs no communication. strict is passed to
    module.load_state_dict, whose result this returns."""
    dist = torch.distributed
    state = dict(full_state)
    for key, dim, group, parts in list(_sharded_entries(module, state)):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if dim is None:
            state[key] = state[key] if rank == 0 else torch.zeros_like(state[key])
        else:
            blocks = state[key].chunk(parts, dim)
            state[key] = torch.cat([b.chunk(size, dim)[rank] for b in blocks], dim)
    return module.load_state_dict(state, strict=strict)


def te_ops_state_dict(module):
    """module.state_dict() in te.ops' layout: each Linear's weight / bias under
    basic_ops.0.weight / basic_ops.1.bias (what te.ops' Linear writes); other keys unchanged. A
    row-parallel Linear's replicated bias is written as te.ops' per-rank summands: the bias on
    rank 0, zeros elsewhere (their sum is the bias, exactly)."""
    out = module.state_dict()
    renames = {}
    for name, m in module.named_modules():
        if isinstance(m, FusibleOperation):
            renames.update(m._te_ops_renames(f"{name}." if name else "", out))
    return type(out)((renames.get(k, k), v) for k, v in out.items())

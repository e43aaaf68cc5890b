"""State dicts across layouts: the single-process model's (gathered from tensor-parallel shards and
loaded back into them) and te.ops' (its Linear's keys). Each op says which of its entries are
sharded (`_sharded_entries`) and how te.ops names them (`_te_ops_renames`)."""

import torch

from ._distributed import sum_over_group
from .op import FusibleOperation


def _sharded_entries(module, state):
    """(key, dim, group) for every tensor-parallel entry of module's state dict: dim 0 or 1, the
    dim the shards split, or None for a per-rank summand (summed, not concatenated)."""
    for name, m in module.named_modules():
        if isinstance(m, FusibleOperation):
            yield from m._sharded_entries(f"{name}." if name else "", state)


def full_state_dict(module):
    """module.state_dict() as the single-process model's: every tensor-parallel shard gathered in
    rank order (column-parallel weights and sharded biases along dim 0, row-parallel weights along
    dim 1) and the per-rank bias summands of a row-parallel Linear built with
    row_parallel_bias="summand" summed (te.ops adds each before the reduction). A collective:
    call it on every rank; every rank gets the whole dict."""
    dist = torch.distributed
    state = module.state_dict()
    for key, dim, group in list(_sharded_entries(module, state)):
        shard = state[key].detach().contiguous()
        if dim is None:
            state[key] = sum_over_group(shard, group)
        else:
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, shard, group=group)
            state[key] = torch.cat(parts, dim)
    return state


def load_full_state_dict(module, full_state, strict=True):
    """Loads full_state, the single-process model's state dict, into this rank's shards of
    module: the inverse of full_state_dict (a per-rank bias summand: the bias on rank 0, zeros
    elsewhere, whose sum is the bias exactly). Needs no communication. strict is passed to
    module.load_state_dict, whose result this returns."""
    dist = torch.distributed
    state = dict(full_state)
    for key, dim, group in list(_sharded_entries(module, state)):
        size = dist.get_world_size(group)
        if dim is None:
            state[key] = state[key] if dist.get_rank(group) == 0 else torch.zeros_like(state[key])
        else:
            state[key] = state[key].chunk(size, dim)[dist.get_rank(group)]
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

"""torch.distributed process groups as the C++ ops take them: (c10d registry name, size, rank)."""

import torch


def group_spec(op_name, group):
    """(name, size, rank) of `group` (None: the default group). The C++ ops run their collectives
    through c10d's functional collectives, which find the group by this name."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{op_name}: tensor parallelism and collectives need a torch.distributed process "
            "group (call torch.distributed.init_process_group first), got none"
        )
    if group is None:
        group = dist.group.WORLD
    return group.group_name, dist.get_world_size(group), dist.get_rank(group)


def tensor_parallel_args(op_name, mode, group, sequence_parallel):
    """BasicLinear's C++ keywords for te.ops' tensor-parallel ones (the C++ op checks the rest)."""
    if mode is None:
        if sequence_parallel:
            raise ValueError(
                f"{op_name}: sequence_parallel needs tensor parallelism (tensor_parallel_mode "
                '"column" or "row")'
            )
        return {}
    name, size, rank = group_spec(op_name, group)
    return dict(
        mode=str(mode),
        group=name,
        group_size=size,
        rank=rank,
        sequence_parallel=bool(sequence_parallel),
    )


def _gather(tensor, dim, group):
    dist = torch.distributed
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim)


def full_state_dict(module):
    """module.state_dict() as the single-process model's: every tensor-parallel shard gathered in
    rank order (column-parallel weights and sharded biases along dim 0, row-parallel weights along
    dim 1) and a row-parallel Linear's per-rank biases summed (te.ops adds each before the
    reduction). A collective: call it on every rank; every rank gets the whole dict."""
    from ._basic import BasicLinear, Bias, Linear

    state = module.state_dict()
    dist = torch.distributed
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        weight, bias = prefix + "weight", prefix + "bias"
        if isinstance(m, (Linear, BasicLinear)) and m.tensor_parallel_mode is not None:
            group = m.tensor_parallel_group
            if weight in state:
                dim = 0 if m.tensor_parallel_mode == "column" else 1
                state[weight] = _gather(state[weight], dim, group)
            if isinstance(m, Linear) and state.get(bias) is not None:
                if m.tensor_parallel_mode == "column":
                    state[bias] = _gather(state[bias], 0, group)
                else:
                    summed = state[bias].detach().clone()
                    dist.all_reduce(summed, group=group)
                    state[bias] = summed
        elif isinstance(m, Bias) and m.tensor_parallel and bias in state:
            state[bias] = _gather(state[bias], 0, m.tensor_parallel_group)
    return state


def _shard(tensor, dim, group):
    dist = torch.distributed
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return tensor.chunk(size, dim)[rank]


def load_full_state_dict(module, full_state, strict=True):
    """Loads the single-process model's state dict into this rank's shards: the inverse of
    full_state_dict (column-parallel weights and sharded biases split along dim 0, row-parallel
    weights along dim 1, a row-parallel Linear's bias divided over the ranks, whose sum te.ops
    adds). Needs no communication. Returns load_state_dict's result."""
    from ._basic import BasicLinear, Bias, Linear

    state = dict(full_state)
    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        weight, bias = prefix + "weight", prefix + "bias"
        if isinstance(m, (Linear, BasicLinear)) and m.tensor_parallel_mode is not None:
            group = m.tensor_parallel_group
            if weight in state:
                dim = 0 if m.tensor_parallel_mode == "column" else 1
                state[weight] = _shard(state[weight], dim, group)
            if isinstance(m, Linear) and state.get(bias) is not None:
                if m.tensor_parallel_mode == "column":
                    state[bias] = _shard(state[bias], 0, group)
                else:
                    state[bias] = state[bias] / torch.distributed.get_world_size(group)
        elif isinstance(m, Bias) and m.tensor_parallel and bias in state:
            state[bias] = _shard(state[bias], 0, m.tensor_parallel_group)
    return module.load_state_dict(state, strict=strict)

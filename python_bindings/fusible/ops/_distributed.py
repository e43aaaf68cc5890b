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
    if mode is None:  # sequence_parallel alone: the C++ op refuses it
        return {"sequence_parallel": True} if sequence_parallel else {}
    name, size, rank = group_spec(op_name, group)
    return dict(
        mode=str(mode),
        group=name,
        group_size=size,
        rank=rank,
        sequence_parallel=bool(sequence_parallel),
    )


def grad_reduction_spec(op_name, sequence_parallel, group):
    """(name, size, rank) of the group a sequence-parallel replicated parameter's gradient is
    summed over (None without sequence parallelism or over one process)."""
    if not sequence_parallel:
        return None
    spec = group_spec(op_name, group)
    return spec if spec[1] > 1 else None


def with_grad_reduction(cpp_op, spec):
    """cpp_op with its parameter gradients summed over `spec`'s group (None: none)."""
    if spec is not None:
        cpp_op.set_param_grad_reduction(spec)
    return cpp_op


def sum_over_group(tensor, group, device=None):
    """A copy of tensor summed over the ranks of group (a collective), on `device` (default:
    tensor's; an NCCL group needs a CUDA tensor)."""
    summed = tensor.detach().to(device, copy=True).contiguous()
    torch.distributed.all_reduce(summed, group=group)
    return summed


def _sharded_entries(module, state):
    """(key, dim, group) for every tensor-parallel entry of module's state dict: dim 0 or 1, the
    dim the shards split, or None for a row-parallel Linear's per-rank bias summand
    (row_parallel_bias="summand"; a replicated bias is the same on every rank: no entry)."""
    from ._basic import BasicLinear, Bias, Linear

    for name, m in module.named_modules():
        prefix = f"{name}." if name else ""
        weight, bias = prefix + "weight", prefix + "bias"
        if isinstance(m, (Linear, BasicLinear)) and m.tensor_parallel_mode is not None:
            column = m.tensor_parallel_mode == "column"
            if weight in state:
                yield weight, 0 if column else 1, m.tensor_parallel_group
            summand = getattr(m, "row_parallel_bias", None) == "summand"
            if isinstance(m, Linear) and state.get(bias) is not None and (column or summand):
                yield bias, 0 if column else None, m.tensor_parallel_group
        elif isinstance(m, Bias) and m.tensor_parallel and bias in state:
            yield bias, 0, m.tensor_parallel_group


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
    """Loads the single-process model's state dict into this rank's shards: the inverse of
    full_state_dict (a per-rank bias summand: the bias on rank 0, zeros elsewhere, whose sum is
    the bias exactly). Needs no communication. Returns load_state_dict's result."""
    dist = torch.distributed
    state = dict(full_state)
    for key, dim, group in list(_sharded_entries(module, state)):
        size = dist.get_world_size(group)
        if dim is None:
            state[key] = state[key] if dist.get_rank(group) == 0 else torch.zeros_like(state[key])
        else:
            state[key] = state[key].chunk(size, dim)[dist.get_rank(group)]
    return module.load_state_dict(state, strict=strict)

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
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # new_group([...]) hands a rank outside the group a placeholder, not a group.
        raise ValueError(
            f"{op_name}: expected a process group this process is a member of, got {group!r} "
            f"(rank {dist.get_rank()} is not in the ranks passed to new_group)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op_name}: expected a torch.distributed ProcessGroup (or None for the default "
            f"group), got {type(group).__name__}"
        )
    return group.group_name, dist.get_world_size(group), dist.get_rank(group)


def tensor_parallel_args(op_name, mode, group, sequence_parallel):
    """BasicLinear's C++ keywords for te.ops' tensor-parallel ones (the C++ op checks the rest)."""
    if mode is None:  # no tensor parallelism: sequence_parallel over one rank is none (te's)
        return {}
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

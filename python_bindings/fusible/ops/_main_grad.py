"""te.ops' accumulate_into_main_grad: a weight gradient added into `weight.main_grad` (Megatron's
buffer) in the op's backward instead of reaching autograd."""

import weakref

import torch


def set_linear_hook(cpp, op):
    """BasicLinear: its backward's wgrad GEMM adds into weight.main_grad itself (fp32 accumulation
    into an fp32 buffer, as te's), asking target() for the buffer and result() for what autograd
    gets."""
    op_ref = weakref.ref(op)  # the C++ op must not keep its Python face alive
    cpp.set_main_grad_hook(
        lambda: target(op_ref().weight, "BasicLinear"), lambda: result(op_ref().weight)
    )


def set_grouped_hook(cpp, op, weight_name):
    """GroupedLinear: as set_linear_hook, for weight parameter i (named weight_name(i))."""
    op_ref = weakref.ref(op)
    cpp.set_main_grad_hook(
        lambda i: target(getattr(op_ref(), weight_name(i)), "GroupedLinear"),
        lambda i: result(getattr(op_ref(), weight_name(i))),
    )


def target(weight, op_label):
    """(weight.main_grad, whether it is overwritten rather than added to), checked against the
    weight."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{op_label} operation is configured with accumulate_into_main_grad=True, "
            "but weight parameter does not have a valid main_grad attribute"
        )
    if tuple(main_grad.shape) != tuple(weight.shape):
        raise RuntimeError(
            f"{op_label}: weight.main_grad has shape {tuple(main_grad.shape)}, expected "
            f"the weight's {tuple(weight.shape)}"
        )
    return main_grad, bool(getattr(weight, "overwrite_main_grad", False))


def result(weight):
    """What autograd gets as the weight's gradient once main_grad holds it (overwritten or added
    to alike, as te's): te.ops' dummy where the weight has grad_added_to_main_grad, else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)

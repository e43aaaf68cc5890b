"""te.ops' accumulate_into_main_grad: a weight gradient added into `weight.main_grad` (Megatron's
buffer) in the op's backward instead of reaching autograd."""

import weakref

import torch


def set_hook(cpp, op, op_label, weight_name):
    """Makes the C++ op's backward hand each weight gradient to into_main_grad; weight_name(i)
    names the weight attribute of op that gradient i belongs to."""
    op_ref = weakref.ref(op)  # the C++ op must not keep its Python face alive
    cpp.set_main_grad_hook(
        lambda *args: into_main_grad(getattr(op_ref(), weight_name(*args[:-1])), args[-1], op_label)
    )


def into_main_grad(weight, dw, op_label):
    """dw added into weight.main_grad (or written, with overwrite_main_grad); returns what
    autograd gets as the weight's gradient: te.ops' dummy convention, else None."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{op_label} operation is configured with accumulate_into_main_grad=True, "
            "but weight parameter does not have a valid main_grad attribute"
        )
    if tuple(main_grad.shape) != tuple(dw.shape):
        raise RuntimeError(
            f"{op_label}: weight.main_grad has shape {tuple(main_grad.shape)}, expected "
            f"the weight's {tuple(dw.shape)}"
        )
    with torch.no_grad():
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(dw)
            return main_grad  # te.ops returns main_grad itself as the weight's gradient
        main_grad.add_(dw)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)

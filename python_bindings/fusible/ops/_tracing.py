"""Cheap checks on every eager call for the transforms fusible routes elsewhere: torch.func (a call
then runs through _func_support) and forward-mode AD (refused by name)."""

import torch

JVP_REFUSED = (
    "fusible: forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) through a "
    "fusible call is not supported; use reverse mode (torch.func.vjp, jacrev, grad)"
)


def refuse_forward_ad(input, extra_inputs):
    """Forward-mode AD (torch.autograd.forward_ad) outside torch.func: refused by name. (Only a
    module-level int is read unless a dual level is open.)"""
    if torch.autograd.forward_ad._current_level < 0:
        return
    for t in (input, *extra_inputs):
        if torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(JVP_REFUSED)


def func_active():
    """Whether a torch.func transform is running (one C call: cheap on the eager path)."""
    return torch._C._functorch.peek_interpreter_stack() is not None

"""torch.func transforms (grad, vjp, vmap, jacrev, functional_call, stack_module_state) over fusible
calls. The fuser's own autograd is a C++ torch::autograd::Function, which functorch cannot see
through; under a transform a Sequential call (and a single op's, through a one-op Sequential) runs
instead as one torch.autograd.Function in functorch's style (setup_context, a vmap rule): its
backward is the recomputing `fusible::sequential_call_backward` (as under torch.compile), and
vmap maps the call over the batch one sample at a time (correct, not fast). Forward-mode AD
(jvp) and second derivatives are refused by name.
"""

import torch

from .. import _C
from . import _compile_support
from ._compile_support import _SEP, _param_paths, _sequential
from ._tracing import JVP_REFUSED


def _owned(outputs, inputs):
    """Outputs that alias an input (or an earlier output) copied: a custom op returns fresh
    tensors."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        elif ptr is not None:
            seen.add(ptr)
        out.append(t)
    return out


class _RngState:
    """The generator state a call's Dropout drew from (an object, not a list: functorch rebuilds
    containers it flattens)."""

    state = None


def _generator(device):
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class _PerSample:
    """The generator states of a vmapped call's samples (randomness="different"), one each: the
    backward of sample b, at the same vmap level, replays the state sample b drew from."""

    def __init__(self, states):
        self.states = states
        self.level = torch._C._functorch.maybe_current_level()


_RNG_ARG = 4  # where _Call takes its _RngState and _CallBackward its state


def _per_sample(apply, info, in_dims, args, rng=None):
    """vmap rule: apply(*args) for each sample of the batched args (the others as they are), the
    outputs stacked along dim 0. rng: "call" where args hold a _Call's _RngState (a training-mode
    Dropout draws), "backward" where they hold the state its backward replays."""
    args = list(args)
    randomness = None
    if rng == "call" and args[_RNG_ARG] is not None:
        randomness = info.randomness
        if randomness == "error":  # torch's own message for a random op under vmap
            raise RuntimeError(
                "vmap: called random operation while in randomness error mode. Please either use "
                "the 'same' or 'different' randomness flags on vmap or perform the randomness "
                "operation out of vmap"
            )
        outer = args[_RNG_ARG]
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        start = _generator(device).get_state()
    results, states = [], []
    for b in range(info.batch_size):
        sample = [
            a if d is None or not isinstance(a, torch.Tensor) else a.select(d, b)
            for a, d in zip(args, in_dims, strict=True)
        ]
        if randomness is not None:
            if randomness == "same":  # every sample draws the same mask
                _generator(device).set_state(start)
            sample[_RNG_ARG] = _RngState()
            states.append(sample[_RNG_ARG])
        elif rng == "backward" and _this_level(args[_RNG_ARG]):
            sample[_RNG_ARG] = args[_RNG_ARG].states[b]
        results.append(apply(*sample))
    if randomness is not None:
        outer.state = (
            states[0].state if randomness == "same" else _PerSample([s.state for s in states])
        )
    stacked = tuple(torch.stack(outs) for outs in zip(*results, strict=True))
    return stacked, (0,) * len(stacked)


def _this_level(states):
    """Whether states are per sample of the vmap whose rule runs now (not of an outer one, as
    under vmap(jacrev(f)), where jacrev's vmap over basis vectors runs first)."""
    return (
        isinstance(states, _PerSample) and states.level == torch._C._functorch.maybe_current_level()
    )


class _Call(torch.autograd.Function):
    """The call of the Sequential named by handle on its tensors [input, extras, named, params]."""

    @staticmethod
    def forward(handle, num_extras, num_named, names, rng, *tensors):
        input, extras, named, params = _compile_support._split(list(tensors), num_extras, num_named)
        if rng is not None:  # a training-mode Dropout: the backward draws from the same state
            rng.state = _generator(input.device).get_state()
        with torch.no_grad():
            outputs = _compile_support._run(
                _sequential(handle), input, extras, names, named, params
            )
        return tuple(_owned(outputs, tensors))

    @staticmethod
    def setup_context(ctx, inputs, output):
        handle, num_extras, num_named, names, rng, *tensors = inputs
        ctx.save_for_backward(*tensors)
        rng_state = rng.state if rng is not None else None
        amp = _compile_support.autocast_arg(tensors[0].device.type)  # the backward recomputes
        ctx.call = (handle, num_extras, num_named, names, rng_state, amp)
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in output]
        ctx.floating = [t.is_floating_point() for t in tensors]

    @staticmethod
    def backward(ctx, *grads):
        grads = [
            g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, ctx.outputs, strict=True)
        ]
        out = _CallBackward.apply(*ctx.call, len(ctx.saved_tensors), *ctx.saved_tensors, *grads)
        # No gradient for a tensor that needs none (an integer one: split sizes).
        out = [g if f else None for g, f in zip(out, ctx.floating, strict=True)]
        return None, None, None, None, None, *out

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(JVP_REFUSED)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _per_sample(_Call.apply, info, in_dims, args, rng="call")


class _CallBackward(torch.autograd.Function):
    """The call's backward (fusible::sequential_call_backward, which recomputes it): the call's
    tensors, then the output gradients -> one gradient per tensor."""

    @staticmethod
    def forward(
        handle, num_extras, num_named, names, rng_state, autocast, num_tensors, *tensors_and_grads
    ):
        tensors = list(tensors_and_grads[:num_tensors])
        grads = list(tensors_and_grads[num_tensors:])
        return tuple(
            torch.ops.fusible.sequential_call_backward(
                handle, tensors, num_extras, num_named, names, grads, "", None, rng_state, autocast
            )
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "fusible: a second derivative (hessian, grad of grad) through a fusible call is not "
            "supported"
        )

    @staticmethod
    def vmap(info, in_dims, *args):  # jacrev: the vjp of each basis vector
        return _per_sample(_CallBackward.apply, info, in_dims, args, rng="backward")


def forward(seq, input, extra_inputs, channel_inputs, return_dict):
    """Sequential.forward under a torch.func transform: one sequential_func call."""
    if return_dict:
        raise NotImplementedError("Sequential: return_dict=True under torch.func is not supported")
    _compile_support.check_traceable(seq, "torch.func")
    if _C._fp8_autocast_state()[0]:
        # The call would run without FP8 (and its backward too): refused, not silently dropped.
        raise NotImplementedError(
            "Sequential: fusible.autocast (FP8) under torch.func transforms is not supported yet; "
            "use torch.autograd (loss.backward()) or torch.compile for FP8"
        )
    paths = _param_paths(seq._compile_handle)
    params = [getattr(seq.get_submodule(path), name) for path, name in paths]
    named = dict(channel_inputs or {})
    names = list(named.keys())
    outputs = _Call.apply(
        seq._compile_handle,
        len(extra_inputs),
        len(names),
        _SEP.join(names),
        # Filled by the call where a training-mode Dropout draws (vmap's randomness applies also
        # without autograd).
        _RngState() if _compile_support.has_training_dropout(seq) else None,
        input,
        *extra_inputs,
        *(named[n] for n in names),
        *params,
    )
    return outputs[0] if len(outputs) == 1 else tuple(outputs)

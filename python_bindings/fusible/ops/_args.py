"""Constructor arguments as the C++ ops take them: device and dtype defaults, te.ops keywords that
are accepted only at their defaults, shapes and GLU layouts."""

import operator

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext


def device_arg(device):
    """device=None: the device of an active `with torch.device(d):` context or of
    torch.set_default_device(d); else None, and C++ picks the current CUDA device or the CPU."""
    if device is None:
        # Both push a DeviceContext mode (as torch.get_default_device reads them).
        for mode in reversed(_get_current_function_mode_stack()):
            if isinstance(mode, DeviceContext):
                device = mode.device
                break
    resolved = None if device is None else torch.device(device)
    if resolved is None:
        on_cuda = torch.cuda.is_available()  # C++ picks the current CUDA device
    else:
        on_cuda = resolved.type == "cuda"
    if on_cuda:
        init_cuda_generators()
    return resolved


def init_cuda_generators():
    """A torch.manual_seed made before Python's first CUDA call reaches the CUDA generators only
    when Python sets CUDA up; our C++ allocates and initializes parameters without that call, and
    would draw from a generator seeded at random in each process."""
    torch.cuda.init()


def dtype_arg(dtype):
    return torch.get_default_dtype() if dtype is None else dtype


def reject_unsupported(op_name, **keywords):
    """te.ops keywords that fusible accepts only at their default: keyword=(value, default)."""
    for name, (value, default) in keywords.items():
        if value != default:
            raise NotImplementedError(f"{op_name}: {name}={value!r} is not supported yet")


def size_arg(op_name, name, value):
    """A size as an int. A float (4.9) or anything else that is not an integer is refused, as
    torch.nn.Linear refuses it, not truncated."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{op_name}: {name} must be an int, got {type(value).__name__} {value!r}"
        ) from None


def as_shape(shape, op_name):
    """An int or an iterable of ints (a list, a range, a 1-D array) as a tuple of ints
    (normalized_shape, as torch.nn.LayerNorm takes it); sizes as size_arg."""
    try:
        return (operator.index(shape),)
    except TypeError:
        pass
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        return (size_arg(op_name, "normalized_shape", shape),)  # raises, naming the type
    return tuple(size_arg(op_name, "normalized_shape", s) for s in shape)


def interleave_size(name, glu_interleave_size):
    """te.ops' glu_interleave_size (None: plain [a | b] halves) as the C++ ops take it (0)."""
    if glu_interleave_size is None:
        return 0
    if isinstance(glu_interleave_size, bool) or int(glu_interleave_size) != glu_interleave_size:
        raise TypeError(f"{name}: glu_interleave_size must be an int or None")
    if glu_interleave_size <= 0:
        raise ValueError(
            f"{name}: glu_interleave_size must be positive or None, got {glu_interleave_size}"
        )
    return int(glu_interleave_size)

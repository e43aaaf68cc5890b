"""Python faces of the C++ operations: each op is a torch.nn.Module whose parameters are the very
tensors the C++ op computes with (one autograd leaf, one storage)."""

import weakref

import torch

from .. import _C


def _device(device):
    return None if device is None else torch.device(device)


def _dtype(dtype):
    return torch.get_default_dtype() if dtype is None else dtype


def reject_unsupported(op_name, **keywords):
    """te.ops keywords that fusible accepts only at their default: keyword=(value, default)."""
    for name, (value, default) in keywords.items():
        if value != default:
            raise NotImplementedError(f"{op_name}: {name}={value!r} is not supported yet")


def unpack_outputs(outputs):
    """[y] -> y; [y, *extras] -> (y, *extras), te.ops' call convention."""
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def check_tensors(name, input, extra_inputs):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor input, got {type(input).__name__}")
    for i, t in enumerate(extra_inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{name}: expected extra input {i} to be a tensor, got " f"{type(t).__name__}"
            )


def split_outputs(outputs, exported):
    """A C++ fuser's [y, exported...] -> ([y, public extra outputs], {name: named outputs})."""
    public, named = [outputs[0]], {}
    for tensor, (is_public, name) in zip(outputs[1:], exported):
        if is_public:
            public.append(tensor)
        if name:
            named[name] = tensor
    return public, named


class FusibleOperation(torch.nn.Module):
    """Base of every fusible op: wraps a C++ op (`_cpp`) and adopts its parameters."""

    is_fused_op = False
    _builtin = True  # a built-in op: its parameters live in the C++ op

    def __init__(self, cpp_op):
        super().__init__()
        self._attach(cpp_op)

    def _attach(self, cpp_op):
        self._cpp = cpp_op
        self._fuser = None  # single-op fuser for plain op(x) calls, made on first use
        cpp_op._py_module = weakref.ref(self)  # fusion functions see the user's own objects
        for name, tensor in cpp_op.own_parameters():
            # Turn the C++ tensor's own Python object into a Parameter: same TensorImpl, same leaf.
            if not isinstance(tensor, torch.nn.Parameter):
                tensor.__class__ = torch.nn.Parameter
            self.register_parameter(name, tensor)

    def __setattr__(self, name, value):
        # A new Parameter for one of the C++ op's parameters: the C++ op must compute with it too.
        params = self.__dict__.get("_parameters")
        if (
            self._builtin
            and params is not None
            and name in params
            and isinstance(value, torch.nn.Parameter)
        ):
            if value is not params[name]:
                self._replace_parameter(name, value)
        super().__setattr__(name, value)

    def _replace_parameter(self, name, value):
        self._cpp.replace_parameter(name, value)
        for op in self._basic_op_list():
            if op is not self and name in op._parameters:
                torch.nn.Module.__setattr__(op, name, value)

    def _apply(self, fn, recurse=True):
        # In place, so the Parameter objects (shared with C++) keep their identity; torch's own
        # _apply would swap in new Parameters for conversions such as meta -> cuda (to_empty).
        if recurse:
            for module in self.children():
                module._apply(fn)
        for param in self._parameters.values():
            if param is None:
                continue
            with torch.no_grad():
                new = fn(param)
                new_grad = fn(param.grad) if param.grad is not None else None
            _C.assign_in_place_(param, new)
            if new_grad is not None:
                param.grad = new_grad
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self

    @property
    def num_extra_inputs(self):
        return sum(op._cpp.num_extra_inputs for op in self._basic_op_list())

    @property
    def num_extra_outputs(self):
        return sum(op._cpp.num_extra_outputs for op in self._basic_op_list())

    def _basic_op_list(self):
        return [self]

    def forward(self, input, *extra_inputs):
        check_tensors(type(self).__name__, input, extra_inputs)
        if self._fuser is None:
            # A plain op(x) call never locks the op's channels.
            self._fuser = _C.OperationFuser([self._cpp], lock_channels=False)
        out = self._fuser.forward(input, list(extra_inputs))
        return unpack_outputs(split_outputs(out, self._fuser.exported())[0])

    def train(self, mode=True):
        super().train(mode)
        self._cpp.train(mode)
        for op in self._basic_op_list():
            if op is not self:
                op.train(mode)
        return self

    def reset_parameters(self):
        # Built-in ops re-initialize in C++; a Python op defines its own (the C++ trampoline calls
        # back here, so this must not call it again).
        if self._builtin:
            self._cpp.reset_parameters()

    def extra_repr(self):
        return ""


def _defines(cls, base, name):
    """Whether a subclass of `base` (not base itself) defines method `name`."""
    return any(name in vars(c) for c in cls.__mro__ if issubclass(c, base) and c is not base)


class BasicOperation(FusibleOperation):
    """A single computation with its own parameters.

    Subclass it in Python with te.ops' protocol: call super().__init__() with no arguments, size
    extra tensors with the class attributes num_extra_inputs / num_extra_outputs, register
    parameters the usual nn.Module way, and implement op_forward / op_backward (or fuser_forward /
    fuser_backward for ops with extra tensors)."""

    def __init__(self, cpp_op=None):
        if cpp_op is not None:  # a built-in op
            super().__init__(cpp_op)
            return
        torch.nn.Module.__init__(self)
        self._builtin = False
        cls = type(self)
        n_in, n_out = vars_int(cls, "num_extra_inputs"), vars_int(cls, "num_extra_outputs")
        self._attach(
            _C.PyBasicOperation(
                self,
                cls.__name__,
                n_in,
                n_out,
                _defines(cls, BasicOperation, "fuser_forward"),
                _defines(cls, BasicOperation, "fuser_backward"),
            )
        )

    # Built-in ops' own forward/backward, callable from Python fused ops.
    def op_forward(self, ctx, input_, **unused):
        return _C.basic_op_forward(self._cpp, ctx, input_)

    def op_backward(self, ctx, grad_output):
        return _C.basic_op_backward(self._cpp, ctx, grad_output)

    def set_extra_output_channel(self, index, channel, *, output_to_caller=True):
        """Names extra-output slot `index` (None unbinds); output_to_caller=False hides it."""
        _check_channel(channel)
        if not isinstance(output_to_caller, bool):
            raise TypeError(
                f"{type(self).__name__}: output_to_caller must be a bool, got "
                f"{type(output_to_caller).__name__}"
            )
        self._cpp.set_extra_output_channel(_check_index(self, index), channel, output_to_caller)
        return self

    def set_extra_input_channel(self, index, channel):
        """Makes extra-input slot `index` take the output named `channel` (None unbinds)."""
        _check_channel(channel)
        self._cpp.set_extra_input_channel(_check_index(self, index), channel)
        return self

    @property
    def channels_locked(self):
        return self._cpp.channels_locked


def vars_int(cls, name):
    """A class attribute that sizes channel slots (0 when not an int: the built-ins' property)."""
    value = getattr(cls, name, 0)
    return value if isinstance(value, int) else 0


def _check_channel(channel):
    if channel is not None and (not isinstance(channel, str) or not channel):
        raise ValueError(f"channel must be None or a non-empty string, got {channel!r}")


def _check_index(op, index):
    if isinstance(index, bool) or not isinstance(index, int):
        raise IndexError(f"{type(op).__name__}: channel index {index!r} is out of range")
    return index


class FusedOperation(FusibleOperation):
    """Several basic ops run as one; `basic_ops` lists them (not registered as submodules, so the
    state dict keeps the fused op's own keys).

    Subclass it in Python with te.ops' protocol: FusedOperation(basic_ops) and fuser_forward and/or
    fuser_backward; a direction left out runs the basic ops unfused."""

    is_fused_op = True

    def __init__(self, basic_ops, *, _cpp=None):
        basic_ops = list(basic_ops)
        if _cpp is None:  # a Python fused op
            torch.nn.Module.__init__(self)
            self._builtin = False
            cls = type(self)
            _cpp = _C.PyFusedOperation(
                self,
                cls.__name__,
                [op._cpp for op in basic_ops],
                _defines(cls, FusedOperation, "fuser_forward"),
                _defines(cls, FusedOperation, "fuser_backward"),
            )
            self._attach(_cpp)
        else:
            super().__init__(_cpp)
        object.__setattr__(self, "basic_ops", basic_ops)

    def _basic_op_list(self):
        return self.basic_ops

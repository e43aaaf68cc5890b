"""te.ops' `ops.op` module: the operation base classes. Each op is a torch.nn.Module over a C++
operation. Its Parameters start as the C++ op's own tensors (one autograd leaf, one storage) and
each call passes the module's current ones ("parameters are call inputs"), so assignment,
functional_call and FSDP's unsharded parameters take effect."""

import copy
import weakref

import torch
from torch import _disable_dynamo

from .. import _C
from ..quantization import _cpp_recipe, has_quantizers, quantizer_view
from . import _fp8_weights
from ._args import init_cuda_generators
from ._call import (
    PreForwardHooks,
    call_parameters,
    check_tensors,
    kwargs_of,
    run_with_op_kwargs,
    split_outputs,
    unpack_outputs,
)
from ._tracing import func_active, refuse_forward_ad

OperationContext = _C.OperationContext

__all__ = ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext"]


_FP8_STATE_FORMAT = "fusible.fp8.delayed_scaling/1"


def _check_mode(mode):
    if mode not in ("forward", "backward"):
        raise ValueError(f"expected mode 'forward' or 'backward', got {mode!r}")


def drop_empty_te_extra_state(state_dict, key):
    """Removes a te.ops `_extra_state` entry that holds no FP8 state (None, an empty tensor or
    empty bytes); one that holds te's FP8 metadata is refused (its format is te's own)."""
    if key not in state_dict:
        return
    value = state_dict[key]
    empty = (
        value is None
        or (isinstance(value, torch.Tensor) and value.numel() == 0)
        or (hasattr(value, "getbuffer") and value.getbuffer().nbytes == 0)
    )
    if not empty:
        raise NotImplementedError(
            f"{key}: reading TransformerEngine's FP8 metadata is not supported yet; load the "
            "checkpoint without it (its weights and biases load as they are)"
        )
    del state_dict[key]


def _frozen_message(op, name):
    cls = type(op).__name__
    return (
        f"{cls}.{name} is fixed at construction (the op and its fusions were built with it); "
        f"build a new {cls} with the value you want and put it in place of this one"
    )


# te.ops' private names of hyperparameters, which te.ops code may write: fixed as the public ones.
_PRIVATE_HYPERPARAMETERS = frozenset(
    {
        "_cache_quantized_input",
        "_activation_recompute_in_mlp",
        "_accumulate_into_main_grad",
        "_scale_bias",
        "_quantize_forward",
        "_quantize_backward",
        "_has_bias",
        "_row_parallel_bias",
        "_sequence_parallel",
        "_reduce_in_backward",
    }
)


def _freezing_init(init):
    """init, after which (the outermost of fusible's constructors) every public attribute the
    constructors set, and te.ops' private names of hyperparameters, is read-only: one rule for
    every op's hyperparameters (eps, p, scale, ...), which the C++ op was built with and a
    compiled graph may have baked in. Attributes a user's
    subclass sets after, and new attributes, stay writable."""

    def wrapped(self, *args, **kwargs):
        depth = self.__dict__.get("_init_depth", 0)
        self.__dict__["_init_depth"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            self.__dict__["_init_depth"] = depth
        if depth == 0:
            frozen = {
                k
                for k in self.__dict__
                if (not k.startswith("_") or k in _PRIVATE_HYPERPARAMETERS)
                and k not in _MODULE_ATTRIBUTES
            }
            self.__dict__["_frozen"] = frozenset(frozen)

    wrapped.__name__, wrapped.__qualname__, wrapped.__doc__ = (
        init.__name__,
        init.__qualname__,
        init.__doc__,
    )
    wrapped.__wrapped__ = init
    return wrapped


def _check_parameter_slot(op, name, old, value):
    """A parameter slot keeps what the op was built with: a Parameter (or tensor) where it had one,
    None where it had none (the op's computation is built around which it holds). ValueError,
    as te.ops raises for a bias set on a Linear without one."""
    if old is None and value is not None:
        raise ValueError(
            f"{type(op).__name__}: built without parameter '{name}'; construct it with that "
            f"parameter (e.g. bias=True) instead of assigning one"
        )
    if old is not None and value is None:
        raise ValueError(
            f"{type(op).__name__}: cannot remove parameter '{name}' (assign None); construct "
            f"the op without it (e.g. bias=False) instead"
        )


def _shared_parameter_message(op, owner, name):
    composite = type(owner).__name__
    return (
        f"{type(op).__name__}: its '{name}' is also its {composite}'s, which computes with it; "
        f"delete, prune or reparametrize it on the {composite} instead"
    )


# Bumped whenever a forward is set on an op instance or deleted from it (accelerate's hooks): a
# Sequential regroups then, with one comparison per call instead of a look at every child.
instance_forward_changes = [0]

_MODULE_ATTRIBUTES = frozenset(torch.nn.Module().__dict__)  # nn.Module's own ("training")


class FusibleOperation(torch.nn.Module):
    """Base of every fusible op: a torch.nn.Module over a C++ operation (`_cpp`).

    The module's parameters are passed to the C++ op at each call; the C++ op's own registered
    tensors matter only for materialization and reset.

    Args:
        cpp_op: the C++ operation (a `fusible._C` object), whose parameters become this
            module's Parameters.
    """

    is_fused_op = False
    _builtin = True  # a built-in op: the C++ op is one of the library's classes
    # The container a single op's call runs through under torch.func and torch.jit.trace: set to
    # Sequential by sequential.py, which builds on this module.
    _one_op_container = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # fusible's own classes: what their constructors set becomes read-only (_freezing_init).
        init = cls.__dict__.get("__init__")
        if init is not None and cls.__module__.startswith("fusible."):
            cls.__init__ = _freezing_init(init)

    def __init__(self, cpp_op):
        super().__init__()
        self._attach(cpp_op)
        for name, tensor in cpp_op.own_parameters():
            # Turn the C++ tensor's own Python object into a Parameter: same TensorImpl, same leaf.
            if not isinstance(tensor, torch.nn.Parameter):
                tensor.__class__ = torch.nn.Parameter
            self.register_parameter(name, tensor)

    def _attach(self, cpp_op):
        self._cpp = cpp_op
        self._fuser = None  # single-op fuser for plain op(x) calls, made on first use
        self.__dict__.pop("_pre_hooks", None)  # its te.ops pre-forward calls, likewise
        cpp_op._py_module = weakref.ref(self)  # fusion functions see the user's own objects

    def _param_sources(self):
        """(module, attribute) of every parameter the C++ basic ops take, in the fuser's order."""
        return [(self, name) for name, _ in self._cpp.own_parameters()]

    # ---- state-dict layouts (state_dict.py): none sharded, te.ops' keys are ours, unless an op
    # (Linear, BasicLinear, Bias) says otherwise.
    def _sharded_entries(self, prefix, state):
        """(key, dim, group) of this op's tensor-parallel entries in state: the dim its shards
        split, or None for a per-rank summand."""
        return ()

    def _te_ops_renames(self, prefix, state):
        """{our key: te.ops' key} for this op's entries of state (values may be rewritten)."""
        return {}

    # ---- FP8 state in checkpoints: an `_extra_state` entry only while some basic op of this
    # module holds delayed-scaling state; a format of our own, plain tensors.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        states = self._fp8_states()
        if any(state is not None for state in states):
            destination[prefix + "_extra_state"] = {"format": _FP8_STATE_FORMAT, "ops": states}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args):
        self._materialize_loaded_meta_parameters(state_dict, prefix, local_metadata)
        key = prefix + "_extra_state"
        if key in state_dict and not isinstance(state_dict[key], dict):
            drop_empty_te_extra_state(state_dict, key)  # te.ops writes one for every op
        if key in state_dict:
            extra = state_dict.pop(key)
            ops = self._basic_op_list()
            if (
                not isinstance(extra, dict)
                or extra.get("format") != _FP8_STATE_FORMAT
                or len(extra.get("ops", ())) != len(ops)
            ):
                raise RuntimeError(
                    f"{type(self).__name__}: {key} is not fusible's FP8 state "
                    f"({_FP8_STATE_FORMAT}) for {len(ops)} basic ops"
                )
            for op, state in zip(ops, extra["ops"]):
                _C._set_fp8_state(op._cpp, state)
        elif strict and args and self._has_fp8_state():
            # As torch.nn.Module for a module with extra state: a missing key (strict=True raises),
            # else the FP8 state of earlier steps would stay with the loaded weights unreported.
            args[0].append(key)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)

    def _materialize_loaded_meta_parameters(self, state_dict, prefix, local_metadata):
        """A deferred (meta) parameter that load_state_dict gives a real tensor becomes real first,
        in place on that tensor's device, so the load takes effect: torch's copy into a meta
        parameter is a no-op (a warning), and the first forward would then have initialized it at
        random, dropping the checkpoint. (assign=True puts the loaded tensor itself in place.)"""
        if local_metadata.get("assign_to_params_buffers", False):
            return
        for name, param in self._parameters.items():
            src = state_dict.get(prefix + name)
            if (
                param is None
                or not param.is_meta
                or type(param) is not torch.nn.Parameter  # an FP8 weight quantizes on its own
                or not isinstance(src, torch.Tensor)
                or src.is_meta
                or src.shape != param.shape  # torch reports the mismatch
            ):
                continue
            real = torch.empty(param.shape, dtype=param.dtype, device=src.device)
            with torch.no_grad():
                _C.assign_in_place_(param, real)

    def _fp8_states(self):
        """Each basic op's delayed-scaling state (None where it holds none), in op order."""
        return [_C._fp8_state(op._cpp) for op in self._basic_op_list()]

    def _has_fp8_state(self):
        return any(state is not None for state in self._fp8_states())

    def num_quantizers(self, mode):
        """How many FP8 quantizers the op uses in mode "forward" or "backward" (te.ops): the
        tensors it casts under an FP8 autocast (a built-in basic op's count comes from C++); 0
        for any other mode, as te.ops'."""
        if mode not in ("forward", "backward") or not self._builtin or self.is_fused_op:
            return 0
        counts = _C._num_quantizers(self._cpp)
        return counts[0] if mode == "forward" else counts[1]

    def _owner_op(self):
        """The composite (Linear) that holds this op's parameters too, if any."""
        owner = self.__dict__.get("_owner")
        return owner() if owner is not None else None

    def _refuse_hook_on_basic_op(self, kind):
        owner = self._owner_op()
        if owner is not None:
            composite = type(owner).__name__
            raise RuntimeError(
                f"{type(self).__name__}: a {kind} hook on a basic op of a {composite} is never "
                f"run (the {composite} computes it, and calls no basic op's forward); register "
                f"it on the {composite} instead"
            )

    # A hook on a Linear's basic op would be kept and never run: refused, as a parametrization is.
    def register_forward_pre_hook(self, *args, **kwargs):
        self._refuse_hook_on_basic_op("forward pre")
        return super().register_forward_pre_hook(*args, **kwargs)

    def register_forward_hook(self, *args, **kwargs):
        self._refuse_hook_on_basic_op("forward")
        return super().register_forward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        self._refuse_hook_on_basic_op("backward pre")
        return super().register_full_backward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        self._refuse_hook_on_basic_op("backward")
        return super().register_full_backward_hook(*args, **kwargs)

    def register_backward_hook(self, *args, **kwargs):
        self._refuse_hook_on_basic_op("backward")
        return super().register_backward_hook(*args, **kwargs)

    def _refuse_displaced_shared_parameter(self):
        """prune, weight_norm and spectral_norm take a parameter out of _parameters directly (no
        __delattr__ to refuse it), then register or set what replaces it: for a parameter a
        composite (Linear) holds too, which would keep computing with it, the parameter goes back
        and the change is refused at its next step."""
        owner = self._owner_op()
        if owner is None:
            return
        for name, _ in self._cpp.own_parameters():
            held = owner._parameters.get(name)
            if name not in self._parameters and held is not None:
                torch.nn.Module.register_parameter(self, name, held)
                raise RuntimeError(_shared_parameter_message(self, owner, name))

    def register_parameter(self, name, param):
        self._refuse_displaced_shared_parameter()
        # Linear's weight/bias are also its basic ops' own: keep those aliases whichever way a
        # parameter is set (assignment, register_parameter, load_state_dict(assign=True)).
        params = self.__dict__.get("_parameters")
        if params is not None and name in params and self._builtin:
            _check_parameter_slot(self, name, params[name], param)
        if params is not None and name in params and isinstance(param, torch.nn.Parameter):
            old = params[name]
            if old is not None and param.shape != old.shape:
                raise RuntimeError(
                    f"{type(self).__name__}: expected parameter '{name}' of shape "
                    f"{list(old.shape)}, got {list(param.shape)}"
                )
            for op in self._basic_op_list():
                if op is not self and name in op._parameters:
                    torch.nn.Module.register_parameter(op, name, param)
        had = params is not None and name in params
        super().register_parameter(name, param)
        owner = self._owner_op()
        if owner is not None and had and owner._parameters.get(name) is not param:
            setattr(owner, name, param)  # the composite computes with it too

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_frozen", ()):
            raise AttributeError(_frozen_message(self, name))
        if isinstance(value, torch.Tensor) and "_owner" in self.__dict__:
            self._refuse_displaced_shared_parameter()
        super().__setattr__(name, value)
        if name == "forward":
            instance_forward_changes[0] += 1
        if name == "training" and "_cpp" in self.__dict__:
            # `m.training = False` (not only m.eval()) switches what the C++ op computes.
            self._cpp.train(bool(value))

    def __delattr__(self, name):
        if name in self.__dict__.get("_frozen", ()):
            raise AttributeError(_frozen_message(self, name))
        owner = self._owner_op()
        if owner is not None and name in self._parameters:
            # What a parametrization does first: the composite would keep computing with the
            # parameter it holds. Refused before anything changed.
            raise RuntimeError(_shared_parameter_message(self, owner, name))
        super().__delattr__(name)
        if name == "forward":
            instance_forward_changes[0] += 1

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

    # ---- copies: the C++ op is rebuilt around the copied Parameters (pickle, deepcopy, save)
    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_cpp", None)
        state.pop("_fuser", None)
        state.pop("_owner", None)  # a weak reference: the copied composite links its copies
        state["_channel_state"] = self._channel_state()
        # A basic op's delayed-scaling state lives in its C++ op: the copy continues from it.
        basic = self._builtin and self._basic_op_list() == [self]
        state["_fp8_state"] = _C._fp8_state(self._cpp) if basic else None
        return state

    def __deepcopy__(self, memo):
        # What copy.deepcopy does through __reduce_ex__, written out: torch's parametrizations
        # (weight_norm, ...) put a subclass in front whose __getstate__ refuses pickling and whose
        # default __deepcopy__ would copy the C++ op itself; ours (the first __getstate__ past
        # that subclass) leaves it out and __setstate__ rebuilds it.
        cls = type(self)
        if torch.nn.utils.parametrize.is_parametrized(self):
            cls = cls.__bases__[0]
        replica = type(self).__new__(type(self))
        memo[id(self)] = replica
        replica.__setstate__(copy.deepcopy(cls.__getstate__(self), memo))
        return replica

    def __setstate__(self, state):
        channels = state.pop("_channel_state", None)
        fp8_state = state.pop("_fp8_state", None)
        super().__setstate__(state)
        self._attach(self._rebuild_cpp())
        self._cpp.train(self.training)
        if fp8_state is not None:
            _C._set_fp8_state(self._cpp, fp8_state)
        self._restore_channels(channels)

    def _rebuild_cpp(self):
        """A new C++ op computing as this one does, holding this module's Parameters."""
        params = [p for p in self._parameters.values() if p is not None]
        cpp = self._make_cpp(torch.device("meta"), params[0].dtype if params else None)
        cpp.adopt_parameters([getattr(self, n) for n, _ in cpp.own_parameters()])
        return cpp

    def _make_cpp(self, device, dtype):
        raise NotImplementedError(f"{type(self).__name__}: cannot rebuild its C++ operation")

    def _channel_state(self):
        return None

    def _restore_channels(self, state):
        pass

    def _sync_cpp_parameters(self):
        """Makes the C++ basic ops hold this module's current Parameters (before a C++ reset)."""
        params = call_parameters(self._param_sources(), for_call=False)
        k = 0
        for op in self._cpp.get_basic_ops():
            n = len(op.own_parameters())
            op.adopt_parameters(params[k : k + n])
            k += n

    @property
    def num_extra_inputs(self):
        return sum(op._cpp.num_extra_inputs for op in self._basic_op_list())

    @property
    def num_extra_outputs(self):
        return sum(op._cpp.num_extra_outputs for op in self._basic_op_list())

    def _basic_op_list(self):
        return [self]

    def _pre_forward_hooks(self):
        """The te.ops pre-forward calls of this op's own plain op(x) fuser, made on first use."""
        hooks = self.__dict__.get("_pre_hooks")
        if hooks is None:
            hooks = self.__dict__["_pre_hooks"] = PreForwardHooks(list(self._basic_op_list()))
        return hooks

    # The C++ trampoline's entry point for an op written in Python that defines fuser_forward:
    # te.ops' keywords plus this call's op_kwargs, one dict per basic op.
    def _call_fuser_forward(self, ctxs, input_, basic_op_extra_inputs):
        return self.fuser_forward(
            ctxs,
            input_,
            basic_op_extra_inputs=basic_op_extra_inputs,
            prev_op_grad_output_quantizer=None,
            next_op_input_quantizer=None,
            basic_op_kwargs=[kwargs_of(op) for op in self._basic_op_list()],
        )

    @_disable_dynamo
    def forward(self, input, *extra_inputs):
        """`y = op(x, *extra_inputs)`; with public extra outputs, `(y, *extra_outputs)`."""
        check_tensors(type(self).__name__, input, extra_inputs)
        refuse_forward_ad(input, extra_inputs)
        if func_active() or torch.jit.is_tracing():
            # torch.func and torch.jit.trace: through a one-op Sequential, which they see as one op
            return self._func_sequential()(input, *extra_inputs)
        if self._fuser is None:
            # A plain op(x) call never locks the op's channels.
            fuser = _C.OperationFuser([self._cpp], lock_channels=False)
            self._fuser = (fuser, self._param_sources())
        fuser, sources = self._fuser
        out = fuser.forward(input, list(extra_inputs), [], call_parameters(sources))
        # Read after the call: this fuser does not lock the channels, which may have changed.
        return unpack_outputs(split_outputs(out, fuser.exported())[0])

    def _func_sequential(self):
        """A Sequential of this op alone (made once): how torch.func and torch.jit.trace call it."""
        seq = self.__dict__.get("_func_seq")
        if seq is None:
            seq = FusibleOperation._one_op_container(self)
            self.__dict__["_func_seq"] = seq  # not a submodule: no cycle in modules()
        return seq

    def train(self, mode=True):
        super().train(mode)
        self._cpp.train(mode)
        for op in self._basic_op_list():
            if op is not self:
                op.train(mode)
        return self

    def reset_parameters(self):
        """Re-initializes the parameters as the constructor does (meta ones become real first)."""
        # Built-in ops re-initialize in C++; a Python op defines its own (the C++ trampoline calls
        # back here, so this must not call it again).
        if self._builtin:
            self._sync_cpp_parameters()
            # Meta parameters become real on the CUDA device when there is one. (Not otherwise:
            # a CPU module may be reset in a forked worker, where CUDA cannot be set up.)
            if torch.cuda.is_available() and any(p.is_cuda or p.is_meta for p in self.parameters()):
                init_cuda_generators()
            self._cpp.reset_parameters()
            _fp8_weights.quantize(self)

    _repr_fields = ()

    def extra_repr(self):
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._repr_fields)


def _defines(cls, base, name):
    """Whether a subclass of `base` (not base itself) defines method `name`."""
    return any(name in vars(c) for c in cls.__mro__ if issubclass(c, base) and c is not base)


def _user_forward(module):
    """Whether a forward of the user's replaces fusible's: one set on the instance, or defined by
    a class outside fusible (a subclass of a built-in op)."""
    if "forward" in module.__dict__:
        return True
    for cls in type(module).__mro__:
        if cls.__module__.split(".")[0] == "fusible":
            return False
        if "forward" in cls.__dict__:
            return True
    return False


def runs_fused(module):
    """Whether a Sequential runs a module inside its fuser groups: a fusible op, unless its class
    overrides forward (a subclass of a built-in op): that one is called as any other module is,
    so its forward is what runs."""
    return isinstance(module, FusibleOperation) and not _user_forward(module)


class BasicOperation(FusibleOperation):
    """A single computation with its own parameters.

    Subclass it in Python with te.ops' protocol: call super().__init__() with no arguments, size
    extra tensors with the class attributes num_extra_inputs / num_extra_outputs, register
    parameters the usual nn.Module way, and implement op_forward / op_backward (or fuser_forward /
    fuser_backward for ops with extra tensors).

    Args:
        cpp_op: the built-in ops' C++ operation; leave it out in a subclass of your own.
    """

    # te.ops' flag: whether the op's quantizers take Float8BlockScaling (its linears do).
    supports_float8_block_scaling = False

    def _fp8_weight_names(self):
        """The parameters quantized_model_init stores in FP8 (where the op has them)."""
        return ["weight"]

    # ---- te.ops' quantizer accessors (FP8): views of the C++ op's recipe and state
    def get_quantizer(self, mode, index):
        """The op's FP8 quantizer `index` for mode "forward" or "backward"; None until the op ran
        under fusible.autocast or reset_recipe_state(recipe=...) made them, and after
        reset_recipe_state(recipe=None) (te.ops')."""
        _check_mode(mode)
        if not self._builtin or not has_quantizers(self._cpp):
            return None
        n = self.num_quantizers(mode)
        if not 0 <= index < n:
            raise IndexError(
                f"{type(self).__name__}: {mode} quantizer {index} out of range ({n} quantizers)"
            )
        return quantizer_view(self._cpp, mode, index)

    def get_quantizer_roles(self, mode):
        """te.ops' explicit quantizer roles: none (the op's own order)."""
        return None

    def get_input_quantizer(self):
        return self.get_quantizer("forward", 0) if self.num_quantizers("forward") > 0 else None

    def get_grad_output_quantizer(self):
        return self.get_quantizer("backward", 0) if self.num_quantizers("backward") > 0 else None

    def reset_recipe_state(self, *, recipe=None):
        """Fresh quantizer state for recipe (None drops it), on the device of the op's
        parameters."""
        params = [p for p in self.parameters(recurse=False) if p.device.type != "meta"]
        device = params[0].device if params else torch.device("cpu")
        _C._reset_fp8_state(self._cpp, None if recipe is None else _cpp_recipe(recipe), device)

    def __init__(self, cpp_op=None):
        if cpp_op is not None:  # a built-in op
            super().__init__(cpp_op)
            return
        torch.nn.Module.__init__(self)
        self._builtin = False
        self._param_names = []  # registration order: op_backward's gradient order
        self._attach(self._python_cpp())

    def register_parameter(self, name, param):
        super().register_parameter(name, param)
        names = self.__dict__.get("_param_names")
        if names is None or name in names:
            return
        # Not a parameter of the op but the storage of a reparametrization: a new name for a
        # parameter in the list (prune registers weight_orig before it removes "weight"), or one
        # registered while a listed parameter is out of _parameters (spectral_norm's
        # weight_orig, the old weight_norm's weight_g and weight_v, a reload of either).
        if param is not None and any(self._parameters.get(n) is param for n in names):
            return
        if any(n not in self._parameters for n in names):
            return
        names.append(name)  # a None slot too: its place is kept for when it is filled

    def _python_cpp(self):
        """The C++ trampoline of an op written in Python."""
        cls = type(self)
        return _C.PyBasicOperation(
            self,
            cls.__name__,
            vars_int(cls, "num_extra_inputs"),
            vars_int(cls, "num_extra_outputs"),
            _defines(cls, BasicOperation, "fuser_forward"),
            _defines(cls, BasicOperation, "fuser_backward"),
        )

    def _rebuild_cpp(self):
        return super()._rebuild_cpp() if self._builtin else self._python_cpp()

    def _param_sources(self):
        if self._builtin:
            return super()._param_sources()
        names = self.__dict__.get("_param_names")
        if names is None:  # an op pickled before the list existed
            return [(self, n) for n, p in self._parameters.items() if p is not None]
        # In registration order, whatever moved them since: a parameter that prune, weight_norm
        # or a parametrization turned into a computed attribute stays in its place (the call
        # passes the computed tensor; autograd takes its gradient on to the stored one). A
        # deleted one is left out.
        cls = type(self)
        return [
            (self, n)
            for n in names
            if self._parameters.get(n) is not None
            or (n not in self._parameters and (n in self.__dict__ or hasattr(cls, n)))
        ]

    def _op_parameters(self):
        """The tensors the C++ trampoline reports (op_parameters): _param_sources' values."""
        return call_parameters(self._param_sources(), for_call=False)

    def _channel_state(self):
        outputs = [tuple(c) for c in self._cpp.extra_output_channels()]
        return list(self._cpp.extra_input_channels()), outputs

    def _restore_channels(self, state):
        if state is None:
            return
        inputs, outputs = state
        for i, channel in enumerate(inputs):
            if channel is not None:
                self._cpp.set_extra_input_channel(i, channel)
        for i, (channel, to_caller) in enumerate(outputs):
            if channel is not None:
                self._cpp.set_extra_output_channel(i, channel, to_caller)

    # te.ops' pre-forward protocol: no-ops unless a Python op defines them.
    def pre_first_fuser_forward(self):
        """Called once, before the first forward of each fuser holding this op."""

    def pre_fuser_forward(self, *, requires_grad):
        """Called before each fuser forward; requires_grad: whether this op's backward runs."""

    def _defines_pre_forward(self):
        """Whether this op (written in Python) defines a te.ops pre-forward hook to call."""
        return not self._builtin and (
            _defines(type(self), BasicOperation, "pre_fuser_forward")
            or _defines(type(self), BasicOperation, "pre_first_fuser_forward")
        )

    # The C++ trampoline's entry point for op_forward: te.ops' keywords plus this call's kwargs.
    def _call_op_forward(self, ctx, input_):
        return self.op_forward(
            ctx,
            input_,
            prev_op_grad_output_quantizer=None,
            next_op_input_quantizer=None,
            **kwargs_of(self),
        )

    @_disable_dynamo
    def forward(self, input, *extra_inputs, **kwargs):
        """`y = op(x, *extra_inputs)`; keywords go to op_forward (te.ops). With public extra
        outputs, `(y, *extra_outputs)`."""
        if not kwargs and self._builtin:
            return FusibleOperation.forward(self, input, *extra_inputs)
        self._pre_forward_hooks()(input, extra_inputs)
        return run_with_op_kwargs(
            [self],
            [kwargs],
            lambda: FusibleOperation.forward(self, input, *extra_inputs),
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
        if not basic_ops:
            raise ValueError(f"{type(self).__name__}: expected at least one basic op, got none")
        if _cpp is None:  # a Python fused op
            torch.nn.Module.__init__(self)
            self._builtin = False
            # te.ops' layout: the basic ops are submodules, so parameters(), state_dict() and
            # .to() reach them through the fused op.
            self.basic_ops = torch.nn.ModuleList(basic_ops)
            self._attach(self._python_cpp())
        else:
            super().__init__(_cpp)
            object.__setattr__(self, "basic_ops", basic_ops)

    def _python_cpp(self):
        cls = type(self)
        return _C.PyFusedOperation(
            self,
            cls.__name__,
            [op._cpp for op in self.basic_ops],
            _defines(cls, FusedOperation, "fuser_forward"),
            _defines(cls, FusedOperation, "fuser_backward"),
        )

    def _rebuild_cpp(self):
        return self._python_cpp()

    def get_input_quantizer(self):
        """The first basic op's input quantizer (te.ops)."""
        return self.basic_ops[0].get_input_quantizer()

    def get_grad_output_quantizer(self):
        """The last basic op's grad-output quantizer (te.ops)."""
        return self.basic_ops[-1].get_grad_output_quantizer()

    def _param_sources(self):
        return [src for op in self.basic_ops for src in op._param_sources()]

    def _basic_op_list(self):
        return self.basic_ops

    def pre_first_fuser_forward(self):
        for op in self.basic_ops:
            op.pre_first_fuser_forward()

    def pre_fuser_forward(self, *, requires_grad):
        for op in self.basic_ops:
            op.pre_fuser_forward(requires_grad=requires_grad)

    @_disable_dynamo
    def forward(self, input, *extra_inputs, basic_op_kwargs=None):
        """`y = op(x, *extra_inputs)`; basic_op_kwargs: one dict of op_forward keywords per basic op
        (te.ops)."""
        self._pre_forward_hooks()(input, extra_inputs)
        if basic_op_kwargs is None:
            return FusibleOperation.forward(self, input, *extra_inputs)
        return run_with_op_kwargs(
            list(self.basic_ops),
            basic_op_kwargs,
            lambda: FusibleOperation.forward(self, input, *extra_inputs),
        )

"""te.ops' `ops.sequential` module: Sequential, the Python face of the C++ Sequential, which
groups the ops, routes channels across groups and calls other Python modules back between them.
Here: the list API, each call's parameters, forward hooks, and te.ops' call convention."""

import operator
from collections import OrderedDict

import torch
from torch.nn.modules import module as _torch_module

from .. import _C, quantization
from . import _call, _compile_support, _func_support
from ._tracing import func_active, refuse_forward_ad
from .fuser import OperationFuser, basic_wrappers
from .op import BasicOperation, FusibleOperation, instance_forward_changes, runs_fused

__all__ = ["Sequential"]


def _check_modules(modules):
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"Sequential: expected a torch.nn.Module, got {type(m).__name__}")


def _global_hooks_set():
    """Whether hooks registered for every module (register_module_forward_hook,
    register_module_forward_pre_hook, register_module_full_backward_hook and
    register_module_full_backward_pre_hook) are set: torch.nn.Sequential's children run them, so
    ours do too."""
    m = _torch_module
    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def _hooks(module, global_hooks=False):
    """Whether a fusible op has hooks, its own (forward or backward) or `global_hooks`: it then
    runs through its own __call__, as a group of its own, so that torch runs them."""
    if not runs_fused(module):
        return False
    return bool(
        global_hooks
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _plain_step(module):
    """A non-fusible module as the C++ Sequential's tensor-to-tensor step."""

    def step(x):
        out = module(x)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"Sequential: {type(module).__name__} between fuser groups must return a tensor, "
                f"got {type(out).__name__}"
            )
        return out

    return step


class Sequential(torch.nn.Module):
    """A list of modules; consecutive fusible ops run as one fuser group each, any other module is
    called as usual between groups. Channels connect ops across groups.

    Args:
        *modules: fusible ops and any other torch.nn.Module, in order; or one dict (an
            OrderedDict, as torch.nn.Sequential takes, or a plain dict, as te.ops') of name ->
            module: its names become the submodules' names.

    Call: `seq(x, *extra_inputs, channel_inputs=None, return_dict=False)`; channel_inputs feeds
    bound extra inputs by channel name, return_dict=True returns `(y, {channel: named output})`.
    """

    def __init__(self, *modules):
        super().__init__()
        self._cpp = None  # the C++ Sequential, built on first use after any change
        _compile_support.register(self)
        if len(modules) == 1 and isinstance(modules[0], dict):  # te's: any dict, in its order
            for name, m in modules[0].items():
                self.append(m, name=name)
            return
        for m in modules:
            self.append(m)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cpp"] = None  # rebuilt on the copy's first call: a copy is not locked
        state.pop("_built_from", None)  # set again with the engine
        state.pop("_forward_changes", None)
        state.pop("_quantize_last", None)  # C++ ops; set again with the engine
        state.pop("_quantize_first", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        _compile_support.register(self)  # a copy has its own handle

    # Every route that sets or removes a child (setattr, register_module / add_module, del)
    # regroups, as the list API below does.
    def __setattr__(self, name, value):
        child = isinstance(value, torch.nn.Module) or name in self.__dict__.get("_modules", {})
        super().__setattr__(name, value)
        if child:
            self._invalidate()

    def __delattr__(self, name):
        child = name in self.__dict__.get("_modules", {})
        super().__delattr__(name)
        if child:
            self._invalidate()

    def add_module(self, name, module):
        super().add_module(name, module)
        self._invalidate()

    register_module = add_module

    # ---- list API (any change drops the C++ Sequential, and with it the channel locks)
    def _invalidate(self):
        self._cpp = None
        _C._forget_sequential(self._compile_handle)  # compiled calls find the rebuilt engine

    def _entries(self):
        return list(self._modules.values())

    def _rebuild(self, modules):
        _check_modules(modules)  # before anything changes: a refused module leaves self as it was
        for key in list(self._modules.keys()):
            del self._modules[key]
        for i, m in enumerate(modules):
            self.add_module(str(i), m)
        self._invalidate()

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._entries())

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # the children keep their names, as torch.nn.Sequential's
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        return self._entries()[idx]

    def __setitem__(self, idx, module):
        if isinstance(idx, slice):
            entries = self._entries()
            entries[idx] = module
            self._rebuild(entries)
            return
        # One position: the module takes that key (as torch.nn.Sequential), names kept.
        _check_modules([module])
        keys = list(self._modules.keys())
        setattr(self, keys[operator.index(idx)], module)

    def __delitem__(self, idx):
        entries = self._entries()
        del entries[idx]
        self._rebuild(entries)

    def append(self, module, name=None):
        """Appends a module (under `name`, else its position); returns self."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential: expected a torch.nn.Module, got {type(module).__name__}")
        if name is None:  # the next free position name (a slice keeps its original names)
            n = len(self._modules)
            while str(n) in self._modules:
                n += 1
            name = str(n)
        self.add_module(name, module)
        self._invalidate()
        return self

    def extend(self, modules):
        """Appends each module; returns self."""
        for m in modules:
            self.append(m)
        return self

    def insert(self, index, module):
        """Inserts a module before position `index`; returns self (as torch.nn.Sequential)."""
        entries = self._entries()
        entries.insert(index, module)
        self._rebuild(entries)
        return self

    def pop(self, index=-1):
        """Removes and returns the module at `index` (a slice: those modules, as a Sequential)."""
        if isinstance(index, slice):
            out = self[index]
            del self[index]
            return out
        entries = self._entries()
        m = entries.pop(index)
        self._rebuild(entries)
        return m

    def __add__(self, other):
        return Sequential(*self._entries(), *list(other))

    def __iadd__(self, other):
        return self.extend(list(other))

    # ---- running: the C++ Sequential groups and routes; this passes parameters and runs hooks
    def _engine(self, global_hooks=None):
        """The C++ Sequential, with its hook flags brought up to date. global_hooks: whether
        global (forward or backward) hooks isolate the ops (an eager call passes whether any are
        set, a compiled one False); None keeps the last call's choice."""
        if global_hooks is None:
            global_hooks = self.__dict__.get("_global_hooks", False)
        self.__dict__["_global_hooks"] = global_hooks
        # A child set through _modules itself (torch.ao.quantization's convert does), or by a
        # shallow copy sharing the dict, bypasses the setters above; a forward set on an op
        # instance (accelerate's hooks) makes it a plain step.
        if self._cpp is not None and (
            self._built_from != tuple(self._modules.values())
            or self._forward_changes != instance_forward_changes[0]
        ):
            self._invalidate()
        if self._cpp is None:
            cpp = _C.Sequential()
            for m in self._modules.values():
                if runs_fused(m):
                    cpp.append_op(m._cpp)
                else:
                    cpp.append_step(_plain_step(m), type(m).__name__)
            fusible = [m for m in self._modules.values() if runs_fused(m)]
            self._param_sources = [src for m in fusible for src in m._param_sources()]
            self._basic = basic_wrappers(fusible)
            self._pre_hooks = _call.PreForwardHooks(self._basic)
            # te.ops hands a last Quantize's output out quantized (quantization.quantized_output).
            last = next(reversed(self._modules.values()), None)
            quantize = getattr(last, "_quantize_forward", False)
            self.__dict__["_quantize_last"] = last._cpp if quantize else None
            # And a first Quantize(backward=True)'s gradient (quantization.quantized_grad).
            first = next(iter(self._modules.values()), None)
            quantize = getattr(first, "_quantize_backward", False)
            self.__dict__["_quantize_first"] = first._cpp if quantize else None
            # Every hook dict of the ops: while all are empty (the usual case) one any() per call
            # tells that nothing changed, instead of four attribute reads per op.
            self._hook_dicts = tuple(
                d
                for m in fusible
                for d in (
                    m._forward_hooks,
                    m._forward_pre_hooks,
                    m._backward_hooks,
                    m._backward_pre_hooks,
                )
            )
            self._built_from = tuple(self._modules.values())
            self._forward_changes = instance_forward_changes[0]
            self._cpp, self._hook_flags = cpp, None  # last: a failure above leaves no engine
        if self._hook_flags is None or self._hooked or global_hooks or any(self._hook_dicts):
            hooks = tuple(_hooks(m, global_hooks) for m in self._modules.values())
            if hooks != self._hook_flags:
                self._cpp.set_isolated(list(hooks))
                self._hook_flags = hooks
                self._hooked = any(hooks)
        return self._cpp

    def forward(self, input, *extra_inputs, op_kwargs=None, channel_inputs=None, return_dict=False):
        """`y = seq(x, *extra_inputs)`. op_kwargs: {basic op (or its index here): op_forward
        keywords} (te.ops); channel_inputs: {channel name: tensor} feeding extra inputs by name;
        return_dict: also return the named extra outputs as a dict."""
        _call.check_tensors("Sequential", input, extra_inputs)
        refuse_forward_ad(input, extra_inputs)
        # Under Dynamo and torch.jit.trace: one custom op (no graph break; a trace that records the
        # same op whatever the fusion plan, and differentiates it through the op's autograd).
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            if op_kwargs:
                raise NotImplementedError("Sequential: op_kwargs under torch.compile")
            return _compile_support.compiled_forward(
                self, input, extra_inputs, channel_inputs, return_dict
            )
        if func_active():  # torch.func: a custom op it can transform (_func_support)
            return _func_support.forward(self, input, extra_inputs, channel_inputs, return_dict)
        # Dynamo never gets here (the branch above), so no _disable_dynamo wrapper on this path.
        # Also sets _param_sources, _basic and _pre_hooks.
        cpp = self._engine(global_hooks=_global_hooks_set())
        quantize_last = self._quantize_last  # its C++ op, or None
        scale = quantization.output_scale(quantize_last) if quantize_last is not None else None
        if self._quantize_first is not None:
            input = quantization.quantized_grad(input, self._quantize_first)
        self._pre_hooks(input, extra_inputs)
        named_inputs = list(channel_inputs.items()) if channel_inputs else []
        params = _call.call_parameters(self._param_sources)
        if op_kwargs is None:  # the usual call: nothing between it and the engine
            outputs, named = self._run_engine(cpp, input, list(extra_inputs), named_inputs, params)
        else:
            outputs, named = _call.run_with_op_kwargs(
                self._basic,
                self._op_kwargs_list(op_kwargs),
                lambda: self._run_engine(cpp, input, list(extra_inputs), named_inputs, params),
            )
        if quantize_last is not None:  # te.ops hands Quantize's output out quantized
            outputs = [quantization.quantized_output(outputs[0], scale), *outputs[1:]]
        if return_dict:
            if len(named) != len(outputs) - 1:
                raise ValueError(
                    "Sequential: return_dict=True needs every public extra output to "
                    "be named (set_extra_output_channel)"
                )
            return outputs[0], dict(named)
        return _call.unpack_outputs(outputs)

    def _op_kwargs_list(self, op_kwargs):
        """te.ops' op_kwargs ({op or index: kwargs}) as one dict per basic op of this Sequential."""
        entries = self._entries()
        by_id = {}
        for key, kwargs in op_kwargs.items():
            if isinstance(key, int) and not -len(entries) <= key < len(entries):
                raise IndexError(
                    f"Sequential: op_kwargs index {key} is out of range for {len(entries)} entries"
                )
            op = entries[key] if isinstance(key, int) else key
            if not isinstance(op, BasicOperation):
                raise ValueError(
                    f"Sequential: op_kwargs key {key!r} is not a basic operation "
                    f"(got {type(op).__name__})"
                )
            if id(op) in by_id:
                raise ValueError(f"Sequential: op_kwargs names {type(op).__name__} twice")
            if sum(b is op for b in self._basic) > 1:
                raise ValueError(
                    f"Sequential: op_kwargs for {type(op).__name__}, which this Sequential holds "
                    "more than once: the keywords would reach every position; use separate op "
                    "objects"
                )
            by_id[id(op)] = kwargs
        if not by_id.keys() <= {id(op) for op in self._basic}:
            raise ValueError("op_kwargs contains keys that are not in this Sequential")
        return [by_id.get(id(op), {}) for op in self._basic]

    def _run_engine(self, cpp, input, extra_inputs, named_inputs, params):
        """One call of cpp (this Sequential's _engine()) with these parameters: (outputs, named
        outputs). Ops with forward hooks run through their own __call__ (the `around` callback)."""
        around = _run_hooked_op(self, {n for n, _ in named_inputs}) if self._hooked else None
        return cpp.run(input, extra_inputs, named_inputs, params, around)

    def fusers(self, named_inputs=()):
        """One entry per group: its OperationFuser, or the module itself."""
        entries = self._entries()
        groups = []
        for cpp_fuser, first in self._engine().groups(set(named_inputs)):
            if cpp_fuser is None:
                groups.append(entries[first])
                continue
            n = len(cpp_fuser.get_basic_ops())
            ops, k = [], first
            while sum(len(op._basic_op_list()) for op in ops) < n:
                ops.append(entries[k])
                k += 1
            groups.append(OperationFuser._view(cpp_fuser, ops))
        return groups

    def fusion_plan(self):
        """For the most recent forward, one entry per group: {"forward": [op type names],
        "backward": [...]} for a fuser group, {"module": type name} for another module."""
        cpp = self._engine()
        plan = cpp.fusion_plan()
        if not plan:  # no forward yet: the grouping, with empty plans
            self.fusers()
            plan = cpp.fusion_plan()
        return plan

    def reset_parameters(self):
        """Re-initializes every child that has parameters."""
        for m in self._entries():
            if hasattr(m, "reset_parameters") and any(True for _ in m.parameters()):
                m.reset_parameters()


def _run_hooked_op(seq, names):
    """The C++ Sequential's `around` callback: runs an isolated op's group through the op's own
    __call__, so its forward pre-hooks and forward hooks see (and may replace) the real input and
    output, exactly as torch.nn.Module runs them."""
    entries = seq._entries()

    def around(entry, x, extra_inputs, run_group):
        op = entries[entry]
        exported = next(f.exported() for f, first in seq._cpp.groups(names) if first == entry)
        result = {}

        def forward(input, *extras):
            # Read here, after the pre-hooks, which may have set the op's parameters.
            result["all"] = run_group(
                input, list(extras), _call.call_parameters(op._param_sources())
            )
            return _call.unpack_outputs(_call.split_outputs(result["all"], exported)[0])

        op.__dict__["forward"] = forward  # what Module.__call__ runs between the hooks
        try:
            out = op(x, *extra_inputs)
        finally:
            del op.__dict__["forward"]
        # Hooks may replace y and public extra outputs; named hidden ones pass through.
        public = iter(list(out) if isinstance(out, tuple) else [out])
        merged = [next(public)]
        for tensor, (is_public, _) in zip(result["all"][1:], exported):
            merged.append(next(public) if is_public else tensor)
        return merged

    return around


# A single op's call under torch.func and torch.jit.trace runs as a one-op Sequential.
FusibleOperation._one_op_container = Sequential

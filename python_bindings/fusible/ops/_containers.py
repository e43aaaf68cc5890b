"""OperationFuser and Sequential: Python faces of the C++ fuser. The per-call path is one C++ call
per fuser group."""

import warnings

import torch
from torch import _disable_dynamo

from .. import _C
from ._base import (
    FusibleOperation,
    call_parameters,
    check_tensors,
    split_outputs,
    unpack_outputs,
)


def _basic_wrappers(ops):
    """The Python basic ops behind a list of Python ops, in forward order."""
    out = []
    for op in ops:
        out.extend(op._basic_op_list())
    return out


class OperationFuser:
    """A callable fuser over a list of fusible ops: plans fusions and runs the whole list forward
    and backward in one autograd node. While alive it holds its ops' channel routing.

    Args:
        ops: a list of fusible ops (composites such as Linear expand into their basic ops).
    """

    def __init__(self, ops, *, _external_inputs=(), _export_channels=()):
        ops = list(ops)
        for op in ops:
            if not isinstance(op, FusibleOperation):
                raise TypeError(f"OperationFuser: expected fusible ops, got {type(op).__name__}")
        self._ops = ops
        self._channels = (set(_external_inputs), set(_export_channels))
        self._basic = _basic_wrappers(ops)
        self._cpp = _C.OperationFuser([op._cpp for op in ops], True, *self._channels)
        self._exported = self._cpp.exported()
        self._public_names = {name for is_public, name in self._exported if is_public and name}
        # Where each parameter of a call is read from, in the C++ fuser's order.
        self._param_sources = [src for op in ops for src in op._param_sources()]
        if len(self._param_sources) != sum(self._cpp.parameter_counts):
            raise RuntimeError(
                f"OperationFuser: the ops report {len(self._param_sources)} parameters but their "
                f"C++ operations take {sum(self._cpp.parameter_counts)}"
            )

    def __getstate__(self):
        return {"ops": self._ops, "channels": self._channels}

    def __setstate__(self, state):
        external, export = state["channels"]
        self.__init__(state["ops"], _external_inputs=external, _export_channels=export)

    @property
    def num_extra_inputs(self):
        return self._cpp.num_extra_inputs

    @property
    def num_extra_outputs(self):
        return self._cpp.num_extra_outputs

    @_disable_dynamo
    def __call__(self, input, *extra_inputs):
        """y = fuser(x, *extra_inputs); with public extra outputs, (y, *extra_outputs)."""
        check_tensors("OperationFuser", input, extra_inputs)
        return unpack_outputs(self._run(input, list(extra_inputs), [])[0])

    def _run(self, input, extra_inputs, named_inputs):
        """-> ([y, public extra outputs], {name: every exported named output})."""
        params = call_parameters(self._param_sources)
        out = self._cpp.forward(input, extra_inputs, named_inputs, params)
        return split_outputs(out, self._exported)

    def extra_input_sources(self):
        return self._cpp.extra_input_sources()

    def _py_op(self, cpp_op, indices):
        if not cpp_op.is_fused and len(indices) == 1:
            return self._basic[indices[0]]
        if isinstance(cpp_op, _C.PyFusedOperation):
            return cpp_op.python_object
        # A built-in fused op made by a fusion: its basic ops as the user's own Python objects.
        cpp_op.basic_ops = [self._basic[i] for i in indices]
        return cpp_op

    def forward_ops(self):
        return [(self._py_op(op, idx), list(idx)) for op, idx in self._cpp.forward_ops()]

    def backward_ops(self):
        return [(self._py_op(op, idx), list(idx)) for op, idx in self._cpp.backward_ops()]

    def fusion_plan(self):
        forward, backward = self._cpp.fusion_plan()
        return [{"forward": list(forward), "backward": list(backward)}]


def _has_forward_hooks(module):
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _has_backward_hooks(module):
    return bool(module._backward_hooks or module._backward_pre_hooks)


_warned_backward_hooks = set()


def _warn_backward_hooks(op):
    if id(op) not in _warned_backward_hooks:
        _warned_backward_hooks.add(id(op))
        warnings.warn(
            f"{type(op).__name__}: backward hooks on an op inside a fusible Sequential do not run "
            "(its backward is part of the fuser's); register the hook on the Sequential instead",
            stacklevel=3,
        )


class Sequential(torch.nn.Module):
    """A list of modules; consecutive fusible ops run as one fuser group each, any other module is
    called as usual between groups. Channels connect ops across groups.

    Args:
        *modules: fusible ops and any other torch.nn.Module, in order.

    Call: seq(x, *extra_inputs, channel_inputs=None, return_dict=False); channel_inputs feeds bound
    extra inputs by channel name, return_dict=True returns (y, {channel: named output}).
    """

    def __init__(self, *modules):
        super().__init__()
        self._groups = None
        for m in modules:
            self.append(m)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_groups"] = None  # fusers are rebuilt on the copy's first call
        return state

    # ---- list API (any change invalidates the grouping)
    def _invalidate(self):
        self._groups = None

    def _entries(self):
        return list(self._modules.values())

    def _rebuild(self, modules):
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
        entries = self._entries()
        if isinstance(idx, slice):
            return Sequential(*entries[idx])
        return entries[idx]

    def __setitem__(self, idx, module):
        entries = self._entries()
        entries[idx] = module
        self._rebuild(entries)

    def __delitem__(self, idx):
        entries = self._entries()
        del entries[idx]
        self._rebuild(entries)

    def append(self, module):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential: expected a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, FusibleOperation) and _has_backward_hooks(module):
            _warn_backward_hooks(module)
        self.add_module(str(len(self._modules)), module)
        self._invalidate()
        return self

    def extend(self, modules):
        for m in modules:
            self.append(m)
        return self

    def insert(self, index, module):
        entries = self._entries()
        entries.insert(index, module)
        self._rebuild(entries)

    def pop(self, index=-1):
        entries = self._entries()
        m = entries.pop(index)
        self._rebuild(entries)
        return m

    def __add__(self, other):
        return Sequential(*self._entries(), *list(other))

    def __iadd__(self, other):
        return self.extend(list(other))

    # ---- grouping and running
    def _hook_state(self):
        """Per module: 1 when a fusible op has forward hooks (it then runs unfused, as its own
        group), 2 when it has backward hooks (they cannot run: a warning), else 0."""
        return tuple(
            isinstance(m, FusibleOperation) and (_has_forward_hooks(m) | 2 * _has_backward_hooks(m))
            for m in self._modules.values()
        )

    def _build_groups(self, named_inputs=frozenset()):
        self._groups = None  # drop the old fusers first: releases their channel locks
        hooked = self._hook_state()
        runs, run = [], []
        for m, hooks in zip(self._entries(), hooked):
            if hooks & 2:
                _warn_backward_hooks(m)
            has_hooks = bool(hooks & 1)
            if isinstance(m, FusibleOperation) and not has_hooks:
                run.append(m)
                continue
            if run:
                runs.append(run)
                run = []
            runs.append([m] if has_hooks else m)
        if run:
            runs.append(run)
        fusible_runs = [r for r in runs if isinstance(r, list)]
        channels = iter(
            _C.plan_group_channels(
                [[op._cpp for op in _basic_wrappers(r)] for r in fusible_runs], set(named_inputs)
            )
        )
        groups = []
        for r in runs:
            if isinstance(r, list):
                external, export = next(channels)
                groups.append(OperationFuser(r, _external_inputs=external, _export_channels=export))
            else:
                groups.append(r)
        self._groups = groups
        self._groups_hooks = hooked
        self._groups_named_inputs = frozenset(named_inputs)
        self._consumed_names = {
            n for g in groups if isinstance(g, OperationFuser) for n in g._cpp.external_inputs()
        }

    def fusers(self):
        """One entry per group: its OperationFuser, or the module itself."""
        if self._groups is None:
            self._build_groups()
        return list(self._groups)

    @_disable_dynamo
    def forward(self, input, *extra_inputs, channel_inputs=None, return_dict=False):
        check_tensors("Sequential", input, extra_inputs)
        channel_inputs = dict(channel_inputs or {})
        names = frozenset(channel_inputs)
        if (
            self._groups is None
            or names != self._groups_named_inputs
            or self._hook_state() != self._groups_hooks
        ):
            self._build_groups(names)
        needed = sum(g.num_extra_inputs for g in self._groups if isinstance(g, OperationFuser))
        if len(extra_inputs) != needed:
            raise ValueError(f"Sequential: expected {needed} extra inputs, got {len(extra_inputs)}")
        unused = [n for n in channel_inputs if n not in self._consumed_names]
        if unused:
            raise ValueError(
                f"Sequential: channel_inputs {unused} feed no bound input that lacks a "
                "producer inside the model"
            )
        channels = list(channel_inputs.items())  # tensors by name, as groups produce them
        x, public, named, k = input, [], {}, 0
        for g in self._groups:
            if not isinstance(g, OperationFuser):
                x = g(x)
                continue
            n = g.num_extra_inputs
            group_extras = list(extra_inputs[k : k + n])
            k += n
            if len(g._ops) == 1 and _has_forward_hooks(g._ops[0]):
                (x, *outs), produced = _run_hooked(g, x, group_extras, channels)
            else:
                (x, *outs), produced = g._run(x, group_extras, channels)
            public.extend(outs)
            channels.extend(produced.items())
            named.update((name, t) for name, t in produced.items() if name in g._public_names)
        if return_dict:
            if len(named) != len(public):
                raise ValueError(
                    "Sequential: return_dict=True needs every public extra output to "
                    "be named (set_extra_output_channel)"
                )
            return x, named
        return unpack_outputs([x, *public])

    def fusion_plan(self):
        """For the most recent forward, one entry per group: {"forward": [op type names],
        "backward": [...]} for a fuser group, {"module": type name} for another module."""
        plan = []
        for g in self.fusers():
            if isinstance(g, OperationFuser):
                plan.extend(g.fusion_plan())
            else:
                plan.append({"module": type(g).__name__})
        return plan

    def reset_parameters(self):
        """Re-initializes every child that has parameters (API.md)."""
        for m in self._entries():
            if hasattr(m, "reset_parameters") and any(True for _ in m.parameters()):
                m.reset_parameters()


def _run_hooked(group, x, extra_inputs, channels):
    """Runs a one-op group through the op's own __call__, so its forward pre-hooks and forward
    hooks see (and may replace) the real input and output, exactly as torch.nn.Module runs them."""
    op = group._ops[0]
    result = {}

    def run_group(input, *extras):
        public, produced = group._run(input, list(extras), channels)
        result["produced"] = produced
        return unpack_outputs(public)

    op.__dict__["forward"] = run_group  # what Module.__call__ runs between the hooks
    try:
        out = op(x, *extra_inputs)
    finally:
        del op.__dict__["forward"]
    public = list(out) if isinstance(out, tuple) else [out]
    return public, result["produced"]

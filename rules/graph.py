"""A module's own forward as a torch.fx graph, traced on the real arguments of one call.

`torch.fx.symbolic_trace` stops at the first Python use of a traced value: `math.sqrt(k.size(-1))`
(nanoGPT's scale), `assert T <= block_size`, `B, T, C = x.shape` followed by `range(T)`. Here every
node also carries the value it has on the call's arguments (as Hugging Face's HFTracer does with
meta tensors, but on real tensors), so such uses get the concrete value and tracing goes on:

- `bool(p)`, `float(p)`, `int(p)`, `len(p)`, `iter(p)` return the concrete answer and are
  recorded in `Traced.specialised` ("float(size) = 64.0"): the graph is then valid for arguments
  of these shapes only, and the caller re-traces for other shapes (`rules/fx_inline.py`);
- non-tensor arguments (None masks, ints, flags) are baked in as constants and keyed likewise.

Children are leaves (their code is their own rules' business); parameters and buffers stay
`get_attr` nodes, so a rewritten GraphModule reuses the module's own objects.

What cannot be traced (a hook, a data-dependent Python branch on a value that is not a tensor
size, an op that fails on the probe) raises `Untraceable` with the reason, which the caller
reports per module and falls back to module-level matching.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches


class Untraceable(Exception):
    """The forward could not be traced into a graph; the message says why."""


@dataclass
class Traced:
    gm: fx.GraphModule
    values: dict[fx.Node, Any]  # each node's value on the traced call
    specialised: list[str] = field(default_factory=list)  # Python uses that baked a value in
    constants: dict[str, Any] = field(default_factory=dict)  # non-tensor arguments, baked in


class _ConcreteProxy(fx.Proxy):
    def _value(self):
        return self.tracer.values[self.node]

    def _spec(self, kind, v):
        self.tracer.specialised.append(f"{kind}({self.node.name}) = {v!r}")
        return v

    def __float__(self):
        return self._spec("float", float(self._value()))

    def __int__(self):
        return self._spec("int", int(self._value()))

    def __index__(self):
        return self._spec("index", operator.index(self._value()))

    def __len__(self):
        return self._spec("len", len(self._value()))


class ConcreteTracer(fx.Tracer):
    def __init__(self, inputs: dict[str, Any]):
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers as get_attr nodes by their own path
        self.inputs = inputs
        self.values: dict[fx.Node, Any] = {}
        self.specialised: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:  # children are opaque calls
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        n = p.node
        if kind == "placeholder":
            name = str(target).lstrip("*")
            if name not in self.inputs:  # fx names a concrete argument's placeholder "mask_1"
                name = name.rpartition("_")[0]
            self.values[n] = self.inputs.get(name)
            return p
        a = fx.node.map_arg(n.args, self._value)
        k = fx.node.map_arg(n.kwargs, self._value)
        try:
            # fx's patches (Module.__call__, wrapped functions) off: the values are computed by
            # plain PyTorch, not traced again.
            with torch.no_grad(), _maybe_revert_all_patches():
                if kind == "call_function":
                    v = target(*a, **k)
                elif kind == "call_method":
                    v = getattr(a[0], target)(*a[1:], **k)
                elif kind == "call_module":
                    v = self.root.get_submodule(target)(*a, **k)
                elif kind == "get_attr":
                    v = _get(self.root, target)
                else:
                    v = None
        except Exception as e:
            raise Untraceable(f"{n.format_node()} failed on the call's values: {type(e).__name__}: {e}") from e
        self.values[n] = v
        return p

    def _value(self, n: fx.Node):
        if n not in self.values and n.op == "get_attr":  # a tensor constant fx made itself
            self.values[n] = _get(self.root, n.target)
        return self.values[n]

    def to_bool(self, obj: fx.Proxy) -> bool:
        v = bool(self.values[obj.node])
        self.specialised.append(f"bool({obj.node.name}) = {v}")
        return v

    def iter(self, obj: fx.Proxy):
        n = len(self.values[obj.node])
        self.specialised.append(f"len({obj.node.name}) = {n}")
        return iter([obj[i] for i in range(n)])


def _get(m: nn.Module, target: str):
    obj = m
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def get_attr(m: nn.Module, target: str):
    """The object at a dotted `get_attr` target, or None."""
    try:
        return _get(m, target)
    except AttributeError:
        return None


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def trace_call(m: nn.Module, args: tuple, kwargs: dict) -> Traced:
    """The graph of `type(m).forward` on this call's arguments (see the module docstring)."""
    if m._forward_hooks or m._forward_pre_hooks:
        raise Untraceable("the module has forward hooks; their effect is not in its forward's code")
    sig = inspect.signature(type(m).forward)
    try:
        bound = sig.bind(m, *args, **kwargs)
    except TypeError as e:
        raise Untraceable(f"arguments don't bind to forward{sig}: {e}") from e
    bound.apply_defaults()
    params = list(sig.parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise Untraceable("forward takes *args/**kwargs; only named arguments are traced")
    inputs, constants = {}, {}
    for p in params:
        v = bound.arguments[p.name]
        if isinstance(v, torch.Tensor):
            inputs[p.name] = _clone(v)  # in-place ops in the forward must not touch the caller's
        else:
            constants[p.name] = v
    tracer = ConcreteTracer({**constants, **inputs})
    try:
        graph = tracer.trace(m, concrete_args=constants or None)
    except Untraceable:
        raise
    except Exception as e:
        raise Untraceable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        made = [k for k in vars(m) if k.startswith("_tensor_constant")]
    gm = fx.GraphModule(m, graph)
    for k in made:  # fx stored constants on the user's module; the GraphModule holds its copy
        delattr(m, k)
    return Traced(gm, tracer.values, tracer.specialised, constants)


# ---------------------------------------------------------------------------------------------
# Node predicates shared by the traced rules


def is_op(n, *targets) -> bool:
    """n calls one of `targets`: functions (torch.softmax), or method names ("softmax")."""
    return isinstance(n, fx.Node) and (
        (n.op == "call_function" and n.target in targets)
        or (n.op == "call_method" and any(isinstance(t, str) and n.target == t for t in targets)))


def is_module_call(n, gm: nn.Module, *types) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_module" and isinstance(get_attr(gm, n.target), types)


def arg(n: fx.Node, i: int, name: str, default=None):
    """Positional-or-keyword argument `i`/`name` of a call node."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def value(tr: Traced, n):
    """A node's value on the traced call (a constant stays itself)."""
    return tr.values.get(n) if isinstance(n, fx.Node) else n

"""Patterns written inline in a forward (no module to swap) -> kprof kernels, on the torch.fx graph.

Two patterns, matched on the graph of one module's own forward (every child module stays a leaf
call, so a child's code is that child's business):

- inline RMSNorm:  x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w   (w a 1-D Parameter,
  either multiplication order, `x.float()` / `.to(dtype)` casts left as they are) -> rms_norm
- inline SwiGLU:   F.silu(g) * u  (or an nn.SiLU child's output times u) -> swiglu

The rewritten graph becomes the module's instance-level forward, so parameters are the module's
own objects, and it is verified against the original forward on the first real call like every
other patch. A module whose forward fx cannot trace (data-dependent control flow, most Hugging
Face modules) is simply not matched; the module-level rules cover those.

Limits (said, not hidden): exactly these spellings; `torch.pow(x, 2)`/`x ** 2`/`x * x` are
accepted for the square, `torch.mean`/`.mean` for the mean; variance computed with other ops
(e.g. `torch.var`) is not an RMSNorm and is left alone.
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules.engine import ProfilePattern, Rule, kernel_fn

RMS, SWIGLU = "rms_norm:rms_norm", "glu:swiglu"


class _OwnCodeTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:  # children are opaque calls
        return True


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and (
        (n.op == "call_function" and n.target in targets)
        or (n.op == "call_method" and any(isinstance(t, str) and n.target == t for t in targets)))


def _square_of(n):
    """x for x.pow(2) / torch.pow(x, 2) / x ** 2 / x * x, else None."""
    if _is(n, torch.pow, operator.pow, "pow") and len(n.args) == 2 and n.args[1] == 2:
        return n.args[0]
    if _is(n, operator.mul, torch.mul, "mul") and len(n.args) == 2 and n.args[0] is n.args[1]:
        return n.args[0]
    return None


def _mean_last(n):
    if not _is(n, torch.mean, "mean"):
        return None
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if dim in (-1, [-1], (-1,)) and keep:
        return n.args[0]
    return None


def _strip_cast(n):
    """x for x.float() / x.to(torch.float32) / x.type_as(...), so both casting styles match."""
    while _is(n, "float", "to", "type_as") and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _rms_sites(gm: fx.GraphModule, m: nn.Module):
    """(x node, weight-mul node, weight get_attr node, eps) for each inline RMSNorm."""
    out = []
    for r in gm.graph.nodes:
        if not _is(r, torch.rsqrt, "rsqrt"):
            continue
        add = r.args[0]
        if not _is(add, operator.add, torch.add, "add") or not isinstance(add.args[1], (int, float)):
            continue
        eps = float(add.args[1])
        sq = _mean_last(add.args[0])
        x = _square_of(sq) if sq is not None else None
        if x is None:
            continue
        for use in r.users:  # x * rsqrt(...)
            if not _is(use, operator.mul, torch.mul, "mul") or _strip_cast(next(a for a in use.args if a is not r)) is not _strip_cast(x):
                continue
            nodes = list(use.users)
            nxt = nodes[0] if len(nodes) == 1 else None
            while nxt is not None and _is(nxt, "to", "type_as", "float") and len(nxt.users) == 1:
                nxt = next(iter(nxt.users))  # a cast between the normalisation and the weight
            if nxt is None or not _is(nxt, operator.mul, torch.mul, "mul"):
                continue
            w = next((a for a in nxt.args if isinstance(a, fx.Node) and a.op == "get_attr"), None)
            if w is None:
                continue
            param = _get(m, w.target)
            if isinstance(param, nn.Parameter) and param.dim() == 1:
                out.append((_strip_cast(x), nxt, w, eps))
    return out


def _get(m: nn.Module, target: str):
    obj = m
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _silu_sites(gm: fx.GraphModule, m: nn.Module):
    """(mul node, gate node, up node) for each `silu(g) * u`."""
    out = []
    for n in gm.graph.nodes:
        if not _is(n, operator.mul, torch.mul, "mul") or len(n.args) != 2:
            continue
        for i in (0, 1):
            a, b = n.args[i], n.args[1 - i]
            is_silu = _is(a, F.silu, torch.nn.functional.silu, "silu") or (
                isinstance(a, fx.Node) and a.op == "call_module" and isinstance(_get(m, a.target), nn.SiLU))
            if is_silu and isinstance(b, fx.Node):
                out.append((n, a.args[0], b))
                break
    return out


def _trace(m: nn.Module) -> fx.GraphModule | None:
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return None
    if "rsqrt" not in src and "silu" not in src:
        return None  # cheap pre-filter: only trace forwards that can hold a pattern
    try:
        graph = _OwnCodeTracer().trace(m)
    except Exception:  # untraceable forward: not this rule's business  # noqa: BLE001
        return None
    return fx.GraphModule(m, graph)


def match(path: str, m: nn.Module) -> dict | None:
    if kernel_fn(RMS) is None or kernel_fn(SWIGLU) is None:
        return None
    gm = _trace(m)
    if gm is None:
        return None
    rms, silu = _rms_sites(gm, m), _silu_sites(gm, m)
    if not rms and not silu:
        return None
    return {"rms_norm": [(w.target, eps) for _, _, w, eps in rms], "swiglu": len(silu)}


def rewrite(m: nn.Module) -> fx.GraphModule:
    """The module's own forward with each inline pattern replaced by a kprof kernel call."""
    gm = _trace(m)
    rms_fn, swiglu_fn = kernel_fn(RMS), kernel_fn(SWIGLU)
    g = gm.graph
    for x, out, w, eps in _rms_sites(gm, m):
        with g.inserting_after(out):
            new = g.call_function(rms_fn, (x, w, eps))
        out.replace_all_uses_with(new)
    for mul, gate, up in _silu_sites(gm, m):
        with g.inserting_after(mul):
            new = g.call_function(swiglu_fn, (gate, up))
        mul.replace_all_uses_with(new)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()
    return gm


def replace(m: nn.Module, p: dict) -> dict:
    gm = rewrite(m)
    # gm holds references to m's own Parameters and children (GraphModule copies attributes by
    # reference), so the override reuses them.
    return {"": gm.forward}


RULE = Rule(
    id="inline_fx",
    title="inline RMSNorm / silu(g)*u in a forward -> rms_norm / swiglu (torch.fx rewrite)",
    kernels=(RMS, SWIGLU),
    match=match,
    replace=replace,
    # A module that computes rsqrt(mean(x^2)) (or silu * up) itself but is not a leaf norm or a
    # 3-Linear MLP: the profile-side twin of the module rules' patterns.
    profile=ProfilePattern(own_all=("rsqrt", "mean"), child_linear=1, evidence=("own:pow", "own:mean", "own:add",
                                                                                 "own:rsqrt", "own:mul", "own:silu")),
    change="kprof rms_norm / swiglu kernels, via a torch.fx rewrite of the module's own forward",
    confidence="medium",
)

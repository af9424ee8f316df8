"""Patterns written inside a forward (no module to swap) -> kprof kernels, on the traced graph.

A module is matched by what its forward computes, never by its class or attribute names: at its
first real call its own forward is traced on that call's arguments (kprof/rules/graph.py: every
child stays a leaf call, every node has its value on the call), each traced rule looks for its
mathematical pattern in the graph, and the sites found are rewritten into kernel calls. The
rewritten GraphModule becomes the module's instance-level forward (it holds the module's own
Parameters and children by reference) and is verified against the original forward, forward and
backward, on that same call (kprof/patching/install.py), like every other patch.

Traced rules (a `Rule` with `sites`): this module's RULE (inline norms, GLUs, bias + GELU) and
attention's (rules/attention.py). Patterns here:

- RMSNorm:  x * rsqrt(mean(x², -1, keepdim) + eps) * w  (any multiplication order, casts kept),
            and F.rms_norm(x, (N,), w, eps)                                       -> rms_norm
- LayerNorm: F.layer_norm(x, (N,), w, b, eps)                                      -> layer_norm
- GLU:      act(g) * u with act SiLU or GELU (F.silu / F.gelu / nn.SiLU / nn.GELU child), g and
            u from separate projections or a chunk/split of one                    -> swiglu/geglu
- bias + GELU: F.gelu(L(x)) for an nn.Linear child L with a bias whose output feeds only the
            GELU                                                  -> F.linear(x, W) + bias_gelu

A forward that cannot be traced is declined for this module with fx's reason (the module-level
rules still see it); a forward whose graph holds none of the patterns is declined with each
rule's reason. Sizes used as Python numbers while tracing (`math.sqrt(k.size(-1))`, `assert`)
make the graph valid for those shapes only: the installed forward keys its graphs by the
arguments' shapes and non-tensor values, traces again (and checks the rewrite against the
original forward) for a new key, and falls back to the original forward past 8 keys.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules.engine import ProfilePattern, Rule, behaves_like, kernel_fn
from kprof.rules.graph import Traced, Untraceable, arg, get_attr, is_module_call, is_op, trace_call, value

RMS, SWIGLU, GEGLU, LN, BIAS_GELU = ("rms_norm:rms_norm", "glu:swiglu", "glu:geglu", "layer_norm:layer_norm",
                                     "bias_gelu:bias_gelu")
MAX_GRAPHS = 8  # distinct argument shapes a specialised graph is re-traced for, then the original


@dataclass
class Site:
    """One pattern found in a traced graph, and how to rewrite it."""

    rule: str  # the rule id that found it
    what: str  # one line for the report ("softmax(q @ kT * c + mask) @ v -> sdpa(is_causal)")
    apply: Callable[[fx.Graph], None]  # rewrites the graph in place (dead code is removed after)


class Declined(Exception):
    """No site was rewritten in this module; the message names the structural reason."""


# ---------------------------------------------------------------------------------------------
# Resolution at the first call (called by kprof/patching/install.py for traced matches)


def _rewrite(tr: Traced, sites: list[Site]) -> fx.GraphModule:
    g = tr.gm.graph
    for s in sites:
        s.apply(g)
    g.eliminate_dead_code()
    g.lint()
    tr.gm.recompile()
    return tr.gm


def find_sites(tr: Traced, m: nn.Module, rules) -> tuple[list[Site], list[str]]:
    sites, declined = [], []
    for rule in rules:
        s, d = rule.sites(tr, m)
        sites += s
        declined += [f"{rule.id}: {why}" for why in d]
    return sites, declined


def resolve(m: nn.Module, params: dict, args: tuple, kwargs: dict) -> tuple[Callable, list[Site], list[str]]:
    """The rewritten forward for `m` from its first call, the sites rewritten and the reasons of
    the rules that found nothing (or declined a site). Raises Declined when nothing is rewritten."""
    rules = params["traced"]
    try:
        tr = trace_call(m, args, kwargs)
    except Untraceable as e:
        raise Declined(f"forward not traceable ({e}); module-level rules only for this module") from None
    sites, declined = find_sites(tr, m, rules)
    if not sites:
        raise Declined("; ".join(declined) or "no traced pattern in this forward")
    what = [s.what for s in sites]
    gm = _rewrite(tr, sites)
    return _guarded(m, gm, tr, rules, what), sites, declined


def _const_key(v):
    try:
        hash(v)
        return v
    except TypeError:
        return ("id", id(v))


def _guarded(m: nn.Module, gm: fx.GraphModule, tr: Traced, rules, what: list[str]) -> Callable:
    sig = inspect.signature(type(m).forward)
    names = list(sig.parameters)[1:]
    specialised = bool(tr.specialised)

    def key_of(bound) -> tuple:
        out = []
        for n in names:
            v = bound.arguments[n]
            if isinstance(v, torch.Tensor):
                out.append(tuple(v.shape) if specialised else None)
            else:
                out.append(_const_key(v))
        return tuple(out)

    def original(*args, **kwargs):
        return type(m).forward(m, *args, **kwargs)

    def retrace(args, kwargs):
        try:
            tr2 = trace_call(m, args, kwargs)
        except Untraceable:
            return None
        sites, _ = find_sites(tr2, m, rules)
        if [s.what for s in sites] != what:
            return None  # another code path: not the rewrite that was verified
        g2 = _rewrite(tr2, sites)
        ok = behaves_like(lambda: original(*args, **kwargs),
                          lambda: g2(*[sig.bind(m, *args, **kwargs).arguments.get(n) for n in names]),
                          _dtype_of(args, kwargs))
        return g2 if ok else None

    first = tr.constants
    cache: dict[tuple, fx.GraphModule | None] = {}
    primed = [False]

    def forward(*args, **kwargs):
        b = sig.bind(m, *args, **kwargs)
        b.apply_defaults()
        key = key_of(b)
        if not primed[0]:  # the traced call's own key maps to the verified graph
            if all(_const_key(b.arguments[n]) == _const_key(v) for n, v in first.items()):
                cache[key] = gm
            primed[0] = True
        if key not in cache:
            cache[key] = retrace(args, kwargs) if len(cache) < MAX_GRAPHS else None
        g = cache[key]
        if g is None:
            return original(*args, **kwargs)
        return g(*[b.arguments[n] for n in names])

    forward.graph_module = gm  # for tests and `kprof apply` reports: the rewritten code
    return forward


def _dtype_of(args, kwargs) -> torch.dtype:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------
# Inline patterns


def _strip_cast(n):
    """x for x.float() / x.to(torch.float32) / x.type_as(...), so both casting styles match."""
    while is_op(n, "float", "to", "type_as") and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _square_of(n):
    """x for x.pow(2) / torch.pow(x, 2) / x ** 2 / x * x, else None."""
    if is_op(n, torch.pow, operator.pow, "pow") and len(n.args) == 2 and n.args[1] == 2:
        return n.args[0]
    if is_op(n, operator.mul, torch.mul, "mul") and len(n.args) == 2 and n.args[0] is n.args[1]:
        return n.args[0]
    return None


def _mean_last(n, tr: Traced):
    if not is_op(n, torch.mean, "mean"):
        return None
    dim, keep = arg(n, 1, "dim"), arg(n, 2, "keepdim", False)
    x = value(tr, n.args[0])
    last = (-1, [-1], (-1,)) + ((x.dim() - 1, [x.dim() - 1], (x.dim() - 1,)) if isinstance(x, torch.Tensor) else ())
    return n.args[0] if dim in last and keep else None


def _param_1d(tr: Traced, m: nn.Module, n) -> bool:
    if not (isinstance(n, fx.Node) and n.op == "get_attr"):
        return False
    p = get_attr(m, n.target)
    return isinstance(p, nn.Parameter) and p.dim() == 1


def _rms_inline(tr: Traced, m: nn.Module) -> list[Site]:
    out = []
    for r in tr.gm.graph.nodes:
        if not is_op(r, torch.rsqrt, "rsqrt"):
            continue
        add = r.args[0]
        if not is_op(add, operator.add, torch.add, "add") or not isinstance(add.args[1], (int, float)):
            continue
        eps = float(add.args[1])
        sq = _mean_last(add.args[0], tr)
        x = _square_of(sq) if sq is not None else None
        if x is None:
            continue
        for use in r.users:  # x * rsqrt(...)
            other = next((a for a in use.args if a is not r), None) if is_op(use, operator.mul, torch.mul, "mul") else None
            if other is None or _strip_cast(other) is not _strip_cast(x):
                continue
            nxt = next(iter(use.users)) if len(use.users) == 1 else None
            while nxt is not None and is_op(nxt, "to", "type_as", "float") and len(nxt.users) == 1:
                nxt = next(iter(nxt.users))  # a cast between the normalisation and the weight
            if nxt is None or not is_op(nxt, operator.mul, torch.mul, "mul"):
                continue
            w = next((a for a in nxt.args if _param_1d(tr, m, a)), None)
            if w is None:
                continue
            x0 = _strip_cast(x)

            def apply(g, x0=x0, w=w, eps=eps, out=nxt):
                with g.inserting_after(out):
                    new = g.call_function(kernel_fn(RMS), (x0, w, eps))
                out.replace_all_uses_with(new)

            out.append(Site("inline_fx", f"x * rsqrt(mean(x^2) + {eps:g}) * {w.target} -> rms_norm", apply))
    return out


def _norm_calls(tr: Traced, m: nn.Module) -> tuple[list[Site], list[str]]:
    """F.rms_norm / F.layer_norm over the last dim with 1-D weights."""
    out, declined = [], []
    for n in tr.gm.graph.nodes:
        is_rms = is_op(n, F.rms_norm, torch.rms_norm)
        if not (is_rms or is_op(n, F.layer_norm, torch.layer_norm)):
            continue
        x = n.args[0]
        shape = value(tr, arg(n, 1, "normalized_shape"))
        w, b = arg(n, 2, "weight"), (None if is_rms else arg(n, 3, "bias"))
        eps = value(tr, arg(n, 3 if is_rms else 4, "eps", None if is_rms else 1e-5))
        name = "F.rms_norm" if is_rms else "F.layer_norm"
        shape = (shape,) if isinstance(shape, int) else tuple(shape or ())
        if len(shape) != 1:
            declined.append(f"{name} over {len(shape)} dims; the kernel normalises the last dim only")
            continue
        wv = value(tr, w)
        if not (isinstance(wv, torch.Tensor) and wv.dim() == 1) or (is_rms and wv is None):
            declined.append(f"{name} without a 1-D weight; the kernel takes one")
            continue
        if is_rms:
            def apply(g, n=n, x=x, w=w, eps=eps):
                with g.inserting_after(n):
                    new = g.call_function(_rms_norm_call, (x, w, eps))
                n.replace_all_uses_with(new)
            out.append(Site("inline_fx", "F.rms_norm -> rms_norm", apply))
        else:
            def apply(g, n=n, x=x, w=w, b=b, eps=eps):
                with g.inserting_after(n):
                    new = g.call_function(kernel_fn(LN), (x, w, b, float(eps)))
                n.replace_all_uses_with(new)
            out.append(Site("inline_fx", "F.layer_norm -> layer_norm", apply))
    return out, declined


def _rms_norm_call(x, w, eps):
    # F.rms_norm's eps=None is the machine epsilon of x's dtype (torch docs)
    return kernel_fn(RMS)(x, w, torch.finfo(x.dtype).eps if eps is None else float(eps))


def _act_of(tr: Traced, m: nn.Module, n) -> str | None:
    """'silu' / 'gelu' / 'gelu_tanh' for an activation call node, else None."""
    if is_op(n, F.silu, torch.nn.functional.silu, "silu") or is_module_call(n, m, nn.SiLU):
        return "silu"
    if is_op(n, F.gelu, "gelu"):
        return "gelu_tanh" if arg(n, 1, "approximate", "none") == "tanh" else "gelu"
    if is_module_call(n, m, nn.GELU):
        return "gelu_tanh" if get_attr(m, n.target).approximate == "tanh" else "gelu"
    if isinstance(n, fx.Node) and n.op == "call_module":
        return _probe_act(get_attr(m, n.target))
    return None


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _probe_act(c) -> str | None:
    """An activation module of any class (HF's ACT2FN objects, a user's own) by what it computes:
    a parameter-free leaf equal to SiLU / GELU / GELU-tanh on a probe."""
    from kprof.rules.engine import closest, param_like, probe_input

    if not isinstance(c, nn.Module) or any(True for _ in c.parameters()) or any(True for _ in c.children()):
        return None
    device, dtype = param_like(c)
    x = probe_input((2, 16), device, dtype, seed=4) * 3  # spread over the curved part
    return closest(lambda: c(x), {k: (lambda f=f: f(x)) for k, f in _ACTS.items()}, dtype)


def _glu_inline(tr: Traced, m: nn.Module) -> list[Site]:
    out = []
    for n in tr.gm.graph.nodes:
        if not is_op(n, operator.mul, torch.mul, "mul") or len(n.args) != 2:
            continue
        for i in (0, 1):
            a, b = n.args[i], n.args[1 - i]
            act = _act_of(tr, m, a)
            if act is None or not isinstance(b, fx.Node):
                continue
            ga, bv = value(tr, a.args[0]), value(tr, b)
            if not (isinstance(ga, torch.Tensor) and isinstance(bv, torch.Tensor) and ga.shape == bv.shape):
                continue  # a broadcast multiply is a scale, not a GLU

            def apply(g, n=n, gate=a.args[0], up=b, act=act):
                with g.inserting_after(n):
                    if act == "silu":
                        new = g.call_function(kernel_fn(SWIGLU), (gate, up))
                    else:
                        new = g.call_function(kernel_fn(GEGLU), (gate, up),
                                              {"approximate": "tanh" if act == "gelu_tanh" else "none"})
                n.replace_all_uses_with(new)

            out.append(Site("inline_fx", f"{act}(g) * u -> {'swiglu' if act == 'silu' else 'geglu'}", apply))
            break
    return out


def _bias_gelu_inline(tr: Traced, m: nn.Module) -> list[Site]:
    out = []
    for n in tr.gm.graph.nodes:
        act = _act_of(tr, m, n)
        if act not in ("gelu", "gelu_tanh") or any(_act_of(tr, m, u) is None and is_op(u, operator.mul, "mul")
                                                  for u in n.users):
            continue  # gelu(g) * u is a GLU
        lin = n.args[0]
        if not is_module_call(lin, m, nn.Linear) or len(lin.users) != 1:
            continue
        mod = get_attr(m, lin.target)
        if mod.bias is None:
            continue
        approximate = "tanh" if act == "gelu_tanh" else "none"

        def apply(g, n=n, lin=lin, approximate=approximate):
            with g.inserting_before(n):
                w = g.get_attr(f"{lin.target}.weight")
                bias = g.get_attr(f"{lin.target}.bias")
                h = g.call_function(F.linear, (lin.args[0], w))
                new = g.call_function(_bias_gelu_call, (h, bias, approximate))
            n.replace_all_uses_with(new)

        out.append(Site("inline_fx", f"gelu({lin.target}(x)) -> matmul + bias_gelu", apply))
    return out


def _bias_gelu_call(h, bias, approximate):
    # Under autocast h is bf16/fp16 and nn.Linear adds the bias cast to that dtype: do the same.
    return kernel_fn(BIAS_GELU)(h, bias.to(h.dtype), approximate=approximate)


def sites(tr: Traced, m: nn.Module) -> tuple[list[Site], list[str]]:
    norms, declined = _norm_calls(tr, m)
    found = _rms_inline(tr, m) + norms + _glu_inline(tr, m) + _bias_gelu_inline(tr, m)
    if not found and not declined:
        declined.append("no inline RMSNorm (rsqrt of a mean of squares times a 1-D weight), F.rms_norm, "
                        "F.layer_norm, act(g) * u or gelu(Linear(x))")
    return found, declined


RULE = Rule(
    id="inline_fx",
    title="inline norms / act(g)*u / gelu(Linear) in a forward -> kprof kernels (graph rewrite)",
    kernels=(RMS, SWIGLU, GEGLU, LN, BIAS_GELU),
    match=None,
    replace=None,
    sites=sites,
    hints=("rsqrt", "rms_norm", "layer_norm", "silu", "gelu", "SiLU", "GELU"),
    # A module that computes rsqrt(mean(x^2)) (or silu * up) itself but is not a leaf norm or a
    # 3-Linear MLP: the profile-side twin of the module rules' patterns.
    profile=ProfilePattern(own_all=("rsqrt", "mean"), child_linear=1, evidence=("own:pow", "own:mean", "own:add",
                                                                                 "own:rsqrt", "own:mul", "own:silu")),
    change="kprof rms_norm / layer_norm / swiglu / geglu / bias_gelu kernels, via a graph rewrite of the "
           "module's own forward",
    confidence="medium",
)

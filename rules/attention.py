"""Attention written out by hand -> F.scaled_dot_product_attention, matched on the traced graph.

Eager materialises the (B, nh, T, T) scores and writes/reads them ~4 times forward (matmul, mask,
softmax, matmul) and more backward; SDPA's flash/memory-efficient kernels keep them on chip. No
kprof kernel is involved: the fix is PyTorch's own fused attention.

The pattern, on the graph of a module's own forward (rules/fx_inline.py traces it at the first
call; the projections, their names and how many there are do not matter):

    softmax(S, dim=-1) [cast] [dropout] @ v      S = q @ kᵀ | einsum("..qd,..kd->..qk", q, k)
                                                 with any of, in any order:
                                                   * c  / c  (a number; also on q or k first)
                                                   masked_fill(m, -inf) | + additive mask
                                                   | where(m, S, -inf)

-> `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)`. The mask
becomes `is_causal=True` when it is built from buffers and sizes only (not from an argument) and
equals the lower triangle at the traced shape (nanoGPT's `tril` buffer, a per-call `triu(-inf)`
additive mask); any other mask (padding, bias, an argument) is passed as `attn_mask` (boolean
keep-mask or additive float). K/V heads repeated for GQA (`repeat_interleave`, expand+reshape)
reach the matmul already repeated and are passed so.

Declined, with the reason in the report: the attention weights used after `@ v` (returned or
stored), softmax over another dim, a scale that is a tensor, dropout with p > 0 in training (SDPA
draws another mask than nn.Dropout, so the first-call check could not prove the patch).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from kprof.kernels.registry import Cost
from kprof.rules.engine import ProfilePattern, Rule
from kprof.rules.fx_inline import Site
from kprof.rules.graph import Traced, arg, get_attr, is_module_call, is_op, value
from kprof.rules.problems import first_shape

_MUL = (operator.mul, torch.mul, "mul")
_DIV = (operator.truediv, torch.div, torch.true_divide, "div")
_MATMUL = (operator.matmul, torch.matmul, "matmul", torch.bmm, "bmm")
_CAST = ("float", "to", "type_as", "half", "bfloat16")
_SOFTMAX = (F.softmax, torch.softmax, "softmax")


def _number(tr: Traced, n) -> float | None:
    v = value(tr, n)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def _strip_scale(tr: Traced, n, factors: list):
    """Peel `* c`, `c *`, `/ c` (c a number, possibly computed from sizes) off n."""
    while True:
        if is_op(n, *_MUL) and len(n.args) == 2:
            a, b = n.args
            if _number(tr, b) is not None and isinstance(a, fx.Node):
                factors.append((b, False))
                n = a
                continue
            if _number(tr, a) is not None and isinstance(b, fx.Node):
                factors.append((a, False))
                n = b
                continue
        if is_op(n, *_DIV) and len(n.args) == 2 and _number(tr, n.args[1]) is not None:
            factors.append((n.args[1], True))
            n = n.args[0]
            continue
        return n


def _very_negative(v) -> bool:
    return isinstance(v, (int, float)) and (v == float("-inf") or v <= -1e4)


def _is_transpose_last2(tr: Traced, n) -> bool:
    if is_op(n, "transpose", torch.transpose) and len(n.args) == 3:
        nd = value(tr, n.args[0]).dim()
        return {d % nd for d in n.args[1:]} == {nd - 2, nd - 1}
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is getattr and n.args[1] == "mT"


def _einsum_perm(sub: str, order: str) -> list[int] | None:
    if sorted(sub) != sorted(order):
        return None
    return [sub.index(c) for c in order]


class _Reject(Exception):
    pass


def _scores_operands(tr: Traced, s):
    """(q, k, permutes or None, batch letters info) for S = q @ kᵀ or an einsum; _Reject otherwise."""
    if is_op(s, *_MATMUL) and len(s.args) == 2:
        q, kt = s.args
        return q, kt, None
    if is_op(s, torch.einsum, "einsum") and len(s.args) == 3 and isinstance(s.args[0], str):
        eq = s.args[0].replace(" ", "")
        if "..." in eq or "->" not in eq:
            raise _Reject(f"einsum {eq!r}: only explicit subscripts are matched")
        ins, out = eq.split("->")
        qs, ks = ins.split(",")
        L = [c for c in qs if c in out and c not in ks]
        S = [c for c in ks if c in out and c not in qs]
        E = [c for c in qs if c in ks and c not in out]
        batch = [c for c in out if c in qs and c in ks]
        if len(L) != 1 or len(S) != 1 or len(E) != 1 or out[-2:] != L[0] + S[0] or out[:-2] != "".join(batch):
            raise _Reject(f"einsum {eq!r} is not q·k over one contracted dim into (..., Lq, Lk)")
        return s.args[1], s.args[2], {"q": _einsum_perm(qs, "".join(batch) + L[0] + E[0]),
                                      "k": _einsum_perm(ks, "".join(batch) + S[0] + E[0])}
    raise _Reject("the softmax input is not q @ kᵀ or an einsum of q and k")


def _pv(tr: Traced, p, pv):
    """(v, output permutation or None) for `p @ v` / einsum(p, v)."""
    if is_op(pv, *_MATMUL) and len(pv.args) == 2 and pv.args[0] is p:
        return pv.args[1], None
    if is_op(pv, torch.einsum, "einsum") and len(pv.args) == 3 and pv.args[1] is p:
        eq = pv.args[0].replace(" ", "")
        ins, out = eq.split("->")
        ps, vs = ins.split(",")
        if len(ps) < 2:
            raise _Reject(f"einsum {eq!r}")
        b, L, S = ps[:-2], ps[-2], ps[-1]
        ev = [c for c in vs if c not in ps]
        if len(ev) != 1 or S not in vs or S in out:
            raise _Reject(f"einsum {eq!r} is not weights·v over the key dim")
        vperm = _einsum_perm(vs, b + S + ev[0])
        operm = _einsum_perm(b + L + ev[0], out)
        if vperm is None or operm is None:
            raise _Reject(f"einsum {eq!r}: v or the output has dims the weights don't")
        return pv.args[2], {"v": vperm, "out": operm}
    raise _Reject("the attention weights are not multiplied into v (p @ v or einsum)")


def _only_user(n):
    return next(iter(n.users)) if len(n.users) == 1 else None


def _static(n, seen=None) -> bool:
    """n is computed from buffers, constants and tensor sizes only (not from an argument's data)."""
    seen = set() if seen is None else seen
    if not isinstance(n, fx.Node) or n in seen:
        return True
    seen.add(n)
    if n.op == "placeholder":
        return False
    if is_op(n, "size", "dim") or (n.op == "call_function" and n.target is getattr and n.args[1] in ("shape", "ndim",
                                                                                                      "device", "dtype")):
        return True
    return all(_static(a, seen) for a in n.all_input_nodes)


def _keep_mask(kind: str, mv, fill=None) -> torch.Tensor | None:
    """The boolean keep-mask a mask value stands for, or None if it is not boolean in effect."""
    if not isinstance(mv, torch.Tensor):
        return None
    if kind == "masked_fill":
        return ~mv.bool()
    if kind == "where":
        return mv.bool()
    if not mv.is_floating_point() or not bool(((mv == 0) | (mv <= -1e4)).all()):
        return None
    return mv == 0


def _is_causal(keep: torch.Tensor | None, L: int, S: int) -> bool:
    if keep is None or keep.dim() < 2 or keep.shape[-2:] != (L, S) or L != S:
        return False
    tril = torch.ones(L, S, dtype=torch.bool, device=keep.device).tril()
    return bool((keep == tril).all())


def _sdpa(q, k, v, attn_mask, dropout, is_causal, scale, perms):
    """The replacement call (one graph node). `dropout`: an nn.Dropout (its p counts in training
    only), a number, or None."""
    if perms is not None:
        q, k = q.permute(perms["q"]), k.permute(perms["k"])
        if "v" in perms:
            v = v.permute(perms["v"])
    p = dropout.p if isinstance(dropout, nn.Module) and dropout.training else (
        dropout if isinstance(dropout, float) else 0.0)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, is_causal=is_causal, scale=scale)
    if perms is not None and "out" in perms:
        y = y.permute(perms["out"])
    return y


def _one_site(tr: Traced, m: nn.Module, sm) -> Site:
    dim = arg(sm, 1, "dim")
    x = value(tr, sm.args[0])
    if not isinstance(x, torch.Tensor) or dim is None or dim % x.dim() != x.dim() - 1:
        raise _Reject("softmax is not over the last dim (the keys)")
    # Forward side: softmax [cast] [dropout] -> @ v
    p, nxt = sm, _only_user(sm)
    if nxt is None:
        raise _Reject("the attention weights are used after the softmax by more than @ v (returned or stored)")
    while is_op(nxt, *_CAST):
        p, nxt = nxt, _only_user(nxt)
        if nxt is None:
            raise _Reject("the attention weights are used by more than @ v")
    dropout = None
    if is_module_call(nxt, m, nn.Dropout) or is_op(nxt, F.dropout):
        if is_module_call(nxt, m, nn.Dropout):
            mod = get_attr(m, nxt.target)
            dropout, live_p = mod, (mod.p if mod.training else 0.0)
        else:
            live_p = float(arg(nxt, 1, "p", 0.5)) if arg(nxt, 2, "training", True) else 0.0
            dropout = live_p
        if live_p > 0:
            raise _Reject(f"dropout p={live_p} in training: SDPA's dropout mask differs from the original's, "
                          "so the first-call check can't prove the patch (p=0 or eval mode is matched)")
        p, nxt = nxt, _only_user(nxt)
        if nxt is None:
            raise _Reject("the dropped-out weights are used by more than @ v")
    v, out_perm = _pv(tr, p, nxt)
    # Backward side: peel casts, masks and scales off the softmax input
    factors, mask, kind = [], None, None
    n = sm.args[0]
    while True:
        n = _strip_scale(tr, n, factors)
        if is_op(n, *_CAST):
            n = n.args[0]
            continue
        if mask is None and is_op(n, "masked_fill", torch.masked_fill) and _very_negative(value(tr, n.args[2])):
            mask, kind, n = n.args[1], "masked_fill", n.args[0]
            continue
        if mask is None and is_op(n, torch.where) and len(n.args) == 3 and _very_negative(value(tr, n.args[2])):
            mask, kind, n = n.args[0], "where", n.args[1]
            continue
        if mask is None and is_op(n, operator.add, torch.add, "add") and len(n.args) == 2:
            a, b = n.args
            av, bv = value(tr, a), value(tr, b)
            if isinstance(bv, torch.Tensor) and isinstance(av, torch.Tensor) and bv.dim() <= av.dim():
                if bv.shape[-2:] == av.shape[-2:] or bv.shape[-1] == av.shape[-1]:
                    mask, kind, n = b, "add", a
                    continue
        break
    if len(n.users) != 1:
        raise _Reject("the raw scores q @ kᵀ are used by more than the softmax")
    q, kt, perms = _scores_operands(tr, n)
    q = _strip_scale(tr, q, factors)
    kt = _strip_scale(tr, kt, factors)
    qv = value(tr, q)
    if perms is None:
        ktv = value(tr, kt)
        if not (isinstance(qv, torch.Tensor) and isinstance(ktv, torch.Tensor) and qv.dim() >= 2 and ktv.dim() >= 2):
            raise _Reject("q or kᵀ is not a tensor of dim >= 2")
        L, S = qv.shape[-2], ktv.shape[-1]
    else:
        L, S = value(tr, n).shape[-2:]
    if out_perm is not None:
        perms = {**(perms or {}), **out_perm}
    scale = 1.0
    for f, inv in factors:
        fv = _number(tr, f)
        scale = scale / fv if inv else scale * fv
    causal = False
    if mask is not None and _static(mask):
        causal = _is_causal(_keep_mask(kind, value(tr, mask)), L, S)
    what = (f"softmax(q·k{' + mask' if mask is not None else ''}) @ v -> sdpa("
            + ("is_causal" if causal else "attn_mask" if mask is not None else "no mask") + ")")

    def apply(g: fx.Graph, q=q, kt=kt, v=v, mask=mask, kind=kind, causal=causal, out=nxt):
        with g.inserting_before(out):
            k = kt if perms is not None else g.call_method("transpose", (kt, -2, -1))
            if mask is None or causal:
                am = None
            elif kind == "masked_fill":
                am = g.call_function(torch.logical_not, (mask,))
            elif kind == "where":
                am = g.call_method("bool", (mask,))
            else:
                am = mask
            sc = 1.0
            for f, inv in factors:  # the scale's own nodes (or numbers), so sizes stay symbolic
                sc = g.call_function(operator.truediv if inv else operator.mul, (sc, f))
            new = g.call_function(_sdpa, (q, k, v, am, dropout_node(g), causal, sc, perms))
        out.replace_all_uses_with(new)

    def dropout_node(g):
        if isinstance(dropout, nn.Module):
            return g.get_attr(next(nm for nm, mod in m.named_modules() if mod is dropout))
        return dropout

    return Site("attention_sdpa", what, apply)


def sites(tr: Traced, m: nn.Module) -> tuple[list[Site], list[str]]:
    out, declined = [], []
    for sm in list(tr.gm.graph.nodes):
        if not is_op(sm, *_SOFTMAX):
            continue
        try:
            out.append(_one_site(tr, m, sm))
        except _Reject as e:
            declined.append(str(e))
    if not out and not declined:
        declined.append("no softmax in this forward")
    return out, declined


def problem(ops) -> dict | None:
    # The first matmul's first input is q: (B, nh, T, hs).
    mm = ops[ops["op"].str.contains("matmul|bmm", regex=True)]
    got = first_shape(mm if len(mm) else ops)
    if got is None or len(got[0]) < 3:
        return None
    shape, dtype = got
    *bh, T, D = shape
    return {"batch_heads": math.prod(bh), "seq": T, "head_dim": D, "dtype": dtype}


def cost(batch_heads: int, seq: int, head_dim: int, dtype: torch.dtype = torch.bfloat16, causal: bool = True) -> dict:
    """Flash attention's work: forward 2 matmuls of 2*BH*T*T*D FLOPs, backward 5 (FlashAttention-2
    paper, sec. 3.1: 2.5x forward), halved for causal; memory q, k, v, o once forward and
    q, k, v, o, do, dq, dk, dv backward, the scores never leave the chip."""
    elt = torch.empty((), dtype=dtype).element_size()
    f = 4.0 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    t = batch_heads * seq * head_dim * elt
    return {"fwd": Cost(f, 4 * t), "bwd": Cost(2.5 * f, 8 * t)}


_PATTERN = dict(own_all=("softmax",), own_any=("matmul", "bmm", "einsum"),
                own_none=("scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                          "scaled_dot_product_efficient_attention"),
                evidence=("own:matmul", "own:bmm", "own:einsum", "own:softmax", "own:masked_fill", "own:div",
                          "own:where"))

RULE = Rule(
    id="attention_sdpa",
    title="hand-written attention -> F.scaled_dot_product_attention",
    kernels=(),
    match=None,
    replace=None,
    sites=sites,
    hints=("softmax",),
    # Any number of projection children (one fused qkv Linear, or q/k/v/o).
    profile=ProfilePattern(**_PATTERN, child_linear=1),
    problem=problem,
    cost=cost,
    tensor_core=True,
    change="torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient kernel)",
    confidence="high",
)

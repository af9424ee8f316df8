"""Hugging Face rotary embedding (`apply_rotary_pos_emb`) -> kprof's fused apply_rope.

Eager rotates q and k with ~10 elementwise kernels (two muls, rotate_half's slice/neg/cat, add,
per tensor); the fused kernel reads q, k, cos, sin once and writes q', k' once.

It is a function, not a module, so the patch replaces the function's name in the Python module of
the model's attention class (the namespace the attention's forward looks it up in). Found by
behaviour, whatever it is called: a plain function of a module that defines one of the model's
classes, taking (q, k, cos, sin, ...), equal to `apply_rope_reference` on a probe. Unpatching restores the original function.
This affects every model of that class in the process while patched (the namespace is shared).

A function that also takes cos/sin narrower than the head dim (GPT-NeoX, Phi-3: partial rotary)
is probed with those too; where it equals the reference's partial form (rotate the first R,
pass the rest through) those calls are fused as well, otherwise they keep the original.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.nn as nn

from kprof.rules.engine import ProfilePattern, Rule, behaves_like, kernel_fn, param_like, reference_fn

KERNEL = "rope:apply_rope"


def find(model: nn.Module) -> list[tuple[str, object, str, dict]]:
    ref = reference_fn(KERNEL)
    if ref is None:
        return []
    device, dtype = param_like(model)
    seen, out = set(), []
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, h, 5, 8, generator=g).to(device, dtype) for h in (4, 2))  # GQA: 4 q, 2 kv heads
    ang = torch.randn(1, 5, 4, generator=g)
    cos, sin = (torch.cat([t, t], -1).to(device, dtype) for t in (ang.cos(), ang.sin()))  # (1, T, D)
    for path, m in model.named_modules():
        ns = sys.modules.get(type(m).__module__)
        if ns is None or id(ns) in seen or ns.__name__.startswith("torch."):
            continue
        seen.add(id(ns))
        for attr, fn in list(vars(ns).items()):
            if not _candidate(fn, ns):
                continue
            if _same(fn, ref, q, k, cos, sin, dtype):
                users = sorted({type(c).__name__ for c in model.modules() if type(c).__module__ == ns.__name__})
                out.append((f"{ns.__name__}.{attr}", ns, attr,
                            {"classes": users, "partial": _partial(fn, ref, q, k, cos, sin, dtype),
                             "calls": {"fused": 0, "original": 0}}))
    return out


def _same(fn, ref, q, k, cos, sin, dtype) -> bool:
    return behaves_like(lambda: torch.cat([t.flatten() for t in fn(q, k, cos, sin)]),
                        lambda: torch.cat([t.flatten() for t in ref(q, k, cos, sin)]), dtype)


def _partial(fn, ref, q, k, cos, sin, dtype) -> str | None:
    """How fn treats cos/sin narrower than the head dim: None if it can't take them (a full
    rotation can't broadcast them), "fused" if it rotates the first cos.shape[-1] of each head
    and passes the rest through as the kernel does (GPT-NeoX, Phi-3's partial rotary),
    "original" for anything else (those calls keep the original function)."""
    narrow = cos[..., :4], sin[..., :4]  # R = 4 of D = 8
    try:
        with torch.no_grad():
            fn(q, k, *narrow)
    except Exception:  # noqa: BLE001  a full-rotation function can't broadcast a narrower cos
        return None
    return "fused" if _same(fn, ref, q, k, *narrow, dtype) else "original"


def _candidate(fn, ns) -> bool:
    """A plain function defined in `ns` that takes (q, k, cos, sin, ...) positionally."""
    if not inspect.isfunction(fn) or fn.__module__ != ns.__name__:
        return False
    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    pos = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in pos if p.default is p.empty]
    return len(pos) >= 4 and len(required) <= 4


def replace_fn(original, params: dict):
    fused = kernel_fn(KERNEL)

    # Only a function whose narrower-cos calls differ from the kernel's partial rotary keeps them.
    keep_partial = params.get("partial") == "original"
    calls = params.setdefault("calls", {"fused": 0, "original": 0})

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if keep_partial and cos.shape[-1] != q.shape[-1]:
            calls["original"] += 1
            return original(q, k, cos, sin, *args, **kwargs)
        calls["fused"] += 1
        return fused(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped_original__ = original
    return apply_rotary_pos_emb


def problem(ops) -> dict | None:
    """q and k shapes from the rotation's multiplies: `q * cos` has inputs (B, Hq, T, D) and
    (B|1, 1, T, D); the first two distinct 4-D first inputs of such muls are q's and k's."""
    from kprof.rules.problems import to_dtype

    fwd = ops[(ops["phase"] == "fwd") & (ops["op"].str.endswith("::mul"))] if len(ops) else ops
    shapes, dtype = [], None
    for s, d in zip(fwd["input_shapes"], fwd["input_dtypes"]):
        s = [tuple(x) for x in s if x is not None and len(x)]
        if len(s) == 2 and len(s[0]) == 4 and len(s[1]) == 4 and s[1][1] == 1 and s[0][2:] == s[1][2:]:
            if s[0] not in shapes:
                shapes.append(s[0])
                dtype = dtype or to_dtype(d[0])
    if len(shapes) < 2:
        return None
    (b, hq, t, dh), (_, hk, _, _) = shapes[:2]
    return {"batch": b, "seq": t, "n_q_heads": hq, "n_kv_heads": hk, "head_dim": dh, "dtype": dtype}


RULE = Rule(
    id="rope",
    title="rotary embedding (apply_rotary_pos_emb) -> fused apply_rope",
    kernels=(KERNEL,),
    match=None,
    replace=None,
    find=find,
    replace_fn=replace_fn,
    # rotate_half's neg + cat inside an attention module, next to the q/k multiplies.
    profile=ProfilePattern(own_all=("neg", "cat", "mul"), child_linear=3,
                           evidence=("own:neg", "own:cat", "own:slice", "own:mul", "own:add")),
    problem=problem,
    change="kprof apply_rope kernel (q and k rotated in one launch)",
    confidence="medium",
)

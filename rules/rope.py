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

The interleaved, complex form (torchtitan, Meta's Llama: `apply_rotary_emb(xq, xk, freqs_cis)`,
xq [B, S, H, D], pairs (2i, 2i + 1) multiplied by the complex freqs_cis [S, D/2]) is found the same
way, by a function taking (xq, xk, freqs_cis) that equals the reference's interleaved form on a
probe. Its patch builds cos/sin from freqs_cis once per call (real and imaginary parts, each
repeated per pair) and casts the outputs to xq's dtype, as `type_as(xq)` does there.
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
        users = sorted({type(c).__name__ for c in model.modules() if type(c).__module__ == ns.__name__})
        called = _names(model, ns)
        for attr, fn in list(vars(ns).items()):
            if _candidate(fn, ns, 4) and _same(fn, ref, q, k, cos, sin, dtype):
                out.append((f"{ns.__name__}.{attr}", ns, attr,
                            {"classes": users, "form": "rotate_half",
                             "partial": _partial(fn, ref, q, k, cos, sin, dtype),
                             "calls": {"fused": 0, "original": 0}}))
            elif attr in called and _candidate(fn, ns, 3) and _complex_form(fn, ref, q, k, ang, dtype):
                out.append((f"{ns.__name__}.{attr}", ns, attr,
                            {"classes": users, "form": "complex", "calls": {"fused": 0, "original": 0}}))
    return out


def _names(model: nn.Module, ns) -> set[str]:
    """Global names the methods of the model's classes defined in `ns` load. A three-argument
    function is common enough (one module may hold several models) that the complex form is
    patched only where one of this model's classes calls it."""
    codes = [f.__code__ for m in model.modules() if type(m).__module__ == ns.__name__
             for f in vars(type(m)).values() if inspect.isfunction(f)]
    names = set()
    while codes:
        c = codes.pop()
        names.update(c.co_names)
        codes.extend(x for x in c.co_consts if inspect.iscode(x))
    return names


def _complex_form(fn, ref, q, k, ang, dtype) -> bool:
    """fn(xq, xk, freqs_cis) with xq [B, S, H, D] and complex freqs_cis [S, D/2] rotates pairs
    (2i, 2i + 1) by freqs_cis: the reference's interleaved form."""
    xq, xk = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    freqs_cis = torch.polar(torch.ones_like(ang[0]), ang[0]).to(q.device)  # complex64 [S, D/2], as torchtitan's
    cos, sin = _cos_sin(freqs_cis, xq)
    return behaves_like(lambda: torch.cat([t.flatten() for t in fn(xq, xk, freqs_cis)]),
                        lambda: torch.cat([t.flatten() for t in ref(xq, xk, cos, sin, unsqueeze_dim=2,
                                                                    interleaved=True)]), dtype)


def _cos_sin(freqs_cis: torch.Tensor, xq: torch.Tensor):
    """(cos, sin) [.., S, D] for the interleaved kernel from a complex64 freqs_cis [S, D/2] or
    [B|1, S, D/2] (each pair's value repeated), or None where freqs_cis is another one."""
    if freqs_cis.dtype != torch.complex64 or xq.dim() != 4 or freqs_cis.dim() not in (2, 3):
        return None  # complex128 would give fp64 cos/sin, which the kernel does not take
    if freqs_cis.shape[-2:] != (xq.shape[1], xq.shape[-1] // 2):
        return None
    if freqs_cis.dim() == 3 and freqs_cis.shape[0] not in (1, xq.shape[0]):
        return None
    return freqs_cis.real.repeat_interleave(2, -1), freqs_cis.imag.repeat_interleave(2, -1)


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


def _candidate(fn, ns, n_args: int) -> bool:
    """A plain function defined in `ns` that takes n_args positionally: (q, k, cos, sin, ...),
    or (xq, xk, freqs_cis, ...)."""
    if not inspect.isfunction(fn) or fn.__module__ != ns.__name__:
        return False
    try:
        ps = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    pos = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in pos if p.default is p.empty]
    return len(pos) >= n_args and len(required) <= n_args


def replace_fn(original, params: dict):
    fused = kernel_fn(KERNEL)
    if params.get("form") == "complex":
        return _replace_complex(original, fused, params)

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


def _replace_complex(original, fused, params: dict):
    calls = params.setdefault("calls", {"fused": 0, "original": 0})

    def apply_rotary_emb(xq, xk, freqs_cis, *args, **kwargs):
        cos_sin = None if args or kwargs else _cos_sin(freqs_cis, xq)
        if cos_sin is None:  # another freqs_cis layout, or extra arguments: the original's code
            calls["original"] += 1
            return original(xq, xk, freqs_cis, *args, **kwargs)
        calls["fused"] += 1
        xq_out, xk_out = fused(xq, xk, *cos_sin, unsqueeze_dim=2, interleaved=True)
        return xq_out.type_as(xq), xk_out.type_as(xk)

    apply_rotary_emb.__wrapped_original__ = original
    return apply_rotary_emb


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

"""Attention written out by hand (q @ k^T, scale, mask, softmax, @ v) -> scaled_dot_product_attention.

Eager materialises the (B, nh, T, T) scores and writes/reads them ~4 times forward (matmul, mask,
softmax, matmul) and more backward; SDPA's flash/memory-efficient kernels keep them on chip. No
kprof kernel is involved: the fix is PyTorch's own fused attention.

Apply can do it for the nanoGPT-shaped self-attention (one fused qkv Linear C -> 3C, an output
Linear C -> C, a head count attribute, causal): the replacement is probe-confirmed against the
module's own forward, then verified on the first real call. Any other hand-written attention
(including Hugging Face's eager path) gets the code change instead.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.kernels.registry import Cost
from kprof.rules.engine import ProfilePattern, Rule, behaves_like, param_like, probe_input
from kprof.rules.problems import first_shape

_HEADS = ("n_head", "num_heads", "n_heads", "num_attention_heads")


def _forward_mentions_sdpa(m: nn.Module) -> bool:
    try:
        return "scaled_dot_product_attention" in inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False


def match(path: str, m: nn.Module) -> dict | None:
    heads = next((getattr(m, a) for a in _HEADS if isinstance(getattr(m, a, None), int)), None)
    if heads is None or _forward_mentions_sdpa(m):
        return None
    lin = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}
    qkv = [n for n, c in lin.items() if c.out_features == 3 * c.in_features]
    proj = [n for n, c in lin.items() if c.out_features == c.in_features]
    if len(qkv) != 1 or len(proj) != 1 or lin[qkv[0]].in_features % heads:
        return None
    p = {"qkv": qkv[0], "proj": proj[0], "heads": heads}
    fwd = replace(m, p)[""]
    device, dtype = param_like(m)
    x = probe_input((2, 5, lin[qkv[0]].in_features), device, dtype)
    if behaves_like(lambda: m.forward(x), lambda: fwd(x), dtype):
        return p
    return None


def replace(m: nn.Module, p: dict) -> dict:
    qkv, proj, nh = getattr(m, p["qkv"]), getattr(m, p["proj"]), p["heads"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return proj(y.transpose(1, 2).contiguous().view(B, T, C))

    return {"": forward}


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


_PATTERN = dict(own_all=("softmax",), own_any=("matmul", "bmm"),
                own_none=("scaled_dot_product_attention", "scaled_dot_product_flash_attention",
                          "scaled_dot_product_efficient_attention"),
                evidence=("own:matmul", "own:bmm", "own:softmax", "own:masked_fill", "own:div", "own:where"))

RULE = Rule(
    id="attention_sdpa",
    title="hand-written attention -> F.scaled_dot_product_attention",
    kernels=(),
    match=match,
    replace=replace,
    # nanoGPT-shaped: a fused qkv Linear and an output Linear (two matmul children).
    profile=ProfilePattern(**_PATTERN, child_linear=1, child_linear_max=2),
    problem=problem,
    cost=cost,
    tensor_core=True,
    change="torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient kernel)",
    code_change=("replace the scores/mask/softmax/matmul lines with "
                 "`y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)`; "
                 "for a Hugging Face model load it with attn_implementation=\"sdpa\""),
    confidence="high",
)


# Any other hand-written attention (separate q/k/v projections, Hugging Face's eager path): the
# same evidence and estimate, but the fix is a code change kprof doesn't make for you.
CODE_RULE = Rule(
    id="attention_sdpa_code",
    title="hand-written attention -> F.scaled_dot_product_attention (code change)",
    kernels=(),
    match=None,
    replace=None,
    profile=ProfilePattern(**_PATTERN, child_linear=3),
    problem=problem,
    cost=cost,
    tensor_core=True,
    change=RULE.change,
    code_change=RULE.code_change,
    confidence="high",
)

"""A recognised MoE block (rules/moe.py) -> kprof's fused path (issue 21 item 5):
router (`moe_router`) -> permute (`moe_permute`) -> grouped SwiGLU experts (`moe_experts`,
torch._grouped_mm) -> weighted unpermute (`moe_unpermute`), plus the shared expert where the
block has one. No host sync: counts and offsets stay on the device (eager HF code reads the
routed count back once per expert).

What is patched: blocks whose experts are SwiGLU over
- stacked 3-D weights [E, 2I, H] + [E, H, I] (HF Mixtral in either experts mode, Qwen2-MoE, OLMoE:
  `F.linear` layout) or [E, H, 2I] + [E, I, H] (x @ W layout): used as (transposed) views, no copy;
- a ModuleList of gated MLPs (three Linears, found by rules/gated_mlp.py's probe, SiLU, no bias):
  stacked per call with torch.stack/cat. That copy costs reading and writing all expert weights
  once per forward (3 E H I elements; 2 x 3 x 8 x 4096 x 14336 x 2 B ~ 5.6 GB of traffic a layer at
  Mixtral-8x7B size, comparable to the grouped GEMMs' own weight reads) and its backward splits
  the stacked grad back (one more pass). Storing the weights stacked removes it; a patch never
  creates Parameters, so it cannot do that for the user.

The router is the block's own [E, H] weight (with its bias if it is an nn.Linear's); the score is
softmax or sigmoid, with or without renormalising the top-k (softmax over the k picked logits is
softmax + renormalise). Which one, the gate/up order and how a shared expert is combined
(added, or scaled by sigmoid of a 1-wide gate as Qwen2-MoE does) are decided by behaviour: the
block's forward on a probe must equal the fused path's, at the verification tolerance.

Declined, with the reason in the patch report (never a wrong patch):
- group-limited routing (DeepSeek-V3: a top-k over expert groups first) -- not implemented;
- a forward that is random in training (router jitter or noise, dropout): the fused path is
  deterministic and would drop the noise;
- capacity factors / token dropping: probed with every token routed to the same experts, where
  any capacity below the token count drops tokens and the outputs differ;
- experts that are not SwiGLU (GELU, a non-gated MLP, biases) or a weight layout not listed above.

`routing_check` compares two routings (chosen experts and weights); exact agreement is demanded
only on tokens whose k-th and (k+1)-th scores are further apart than the dtype's tolerance (a
near-tie may legitimately flip between two correct implementations). The match probe runs it
between the block's own top-k and `moe_router` on the same logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kprof.rules import gated_mlp, moe
from kprof.rules.engine import (ProfilePattern, Rule, behaves_like, kernel_fn, param_like, probe_error, probe_input,
                               probe_mode, reference_fn)

ID = "moe_fused"
ROUTER, PERMUTE, UNPERMUTE, EXPERTS = ("moe_router:moe_router", "moe_permute:moe_permute",
                                       "moe_permute:moe_unpermute", "moe_experts:moe_experts")


# ---------------------------------------------------------------------------------------------
# Routing comparison


def routing_check(scores: torch.Tensor, idx_a: torch.Tensor, w_a: torch.Tensor, idx_b: torch.Tensor,
                  w_b: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[bool, str]:
    """(ok, what differs) for two routings of the same tokens. `scores` [T, E]: the scores the
    selection ranks (any monotonic transform of the logits). A token is decided when its k-th
    and (k+1)-th scores differ by more than atol + rtol |k-th| of `dtype`'s tolerance; there the
    chosen expert sets must be equal and the weights (matched by expert) allclose. Undecided
    tokens (near-ties) are skipped: both picks are correct there."""
    from kprof.kernels.common import TOLERANCE

    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    s = scores.float()
    e = s.shape[-1]
    top = torch.topk(s, min(k + 1, e), dim=-1).values
    decided = (torch.ones(s.shape[0], dtype=torch.bool, device=s.device) if k >= e
               else (top[:, k - 1] - top[:, k]).abs() > tol.atol + tol.rtol * top[:, k - 1].abs())
    ia, order_a = idx_a.long().sort(-1)
    ib, order_b = idx_b.long().sort(-1)
    same = (ia == ib).all(-1)
    bad = decided & ~same
    if bool(bad.any()):
        return False, f"{int(bad.sum())} of {int(decided.sum())} decided tokens chose other experts"
    wa, wb = w_a.float().gather(-1, order_a), w_b.float().gather(-1, order_b)
    close = torch.isclose(wa, wb, atol=tol.atol, rtol=tol.rtol).all(-1)
    bad = decided & same & ~close
    if bool(bad.any()):
        return False, f"{int(bad.sum())} of {int(decided.sum())} decided tokens have other routing weights"
    return True, f"{int(decided.sum())} of {s.shape[0]} tokens decided, all agree"


class _TopK(TorchFunctionMode):
    """Keeps the input and output of the last top-k over `n` columns (the block's routing)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.last = n, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.topk, torch.Tensor.topk) and args and isinstance(args[0], torch.Tensor) \
                and args[0].shape[-1] == self.n:
            self.last = (args[0].detach(), out[0].detach(), out[1].detach())
        return out


# ---------------------------------------------------------------------------------------------
# Expert weights


def _expert_weights(m: nn.Module, d: dict) -> tuple[list, str | None]:
    """Candidate `(name, fn)` pairs, fn() -> (w_gate_up [E, H, 2I], w_down [E, I, H]) over the
    block's own Parameters; or the reason there are none."""
    ex = m.get_submodule(d["experts"]) if d["experts"] else m
    h = d["hidden"]
    if d["expert_storage"] == "modulelist":
        kids = list(ex.children())
        p = gated_mlp.match("", kids[0])
        if p is None or p["act"] != "silu":
            return [], "experts are not SwiGLU MLPs (three Linears, silu(gate) * up)"
        lins = [[getattr(c, p[r]) for r in ("gate", "up", "down")] for c in kids]
        if any(lin.bias is not None for trio in lins for lin in trio):
            return [], "expert Linears have biases (the grouped GEMM path has none)"
        gates, ups, downs = ([t[j].weight for t in lins] for j in range(3))

        def stacked():
            # A copy of every expert's weights, each call (see the module docstring for its cost).
            gu = torch.cat([torch.stack(gates), torch.stack(ups)], dim=1)  # [E, 2I, H]
            return gu.transpose(1, 2), torch.stack(downs).transpose(1, 2)

        return [("stacked per call", stacked)], None
    w3 = [p for p in ex.parameters(recurse=False) if p.dim() == 3]
    if len(w3) != 2:
        return [], f"{len(w3)} stacked expert weights (a gate_up and a down weight expected)"
    out = []
    for a, b in ((w3[0], w3[1]), (w3[1], w3[0])):
        e, r, c = a.shape
        if r % 2 == 0 and c == h and b.shape == (e, h, r // 2):  # F.linear layout [E, 2I, H], [E, H, I]
            out.append(("linear layout", lambda a=a, b=b: (a.transpose(1, 2), b.transpose(1, 2))))
        if r == h and c % 2 == 0 and b.shape == (e, c // 2, h):  # matmul layout [E, H, 2I], [E, I, H]
            out.append(("matmul layout", lambda a=a, b=b: (a, b)))
    return out, (None if out else "stacked expert weights in a layout other than gate_up + down")


def _halves(gu: torch.Tensor, up_first: bool) -> torch.Tensor:
    """w_gate_up with the gate in the first I columns (swiglu_packed's layout). Up-first weights
    are reordered by a cat: a copy of the gate_up weights each call (none for gate-first, HF's)."""
    if not up_first:
        return gu
    i = gu.shape[-1] // 2
    return torch.cat([gu[..., i:], gu[..., :i]], dim=-1)


def _shared(m: nn.Module, d: dict) -> tuple[list, str | None]:
    """Candidate combiners of the shared children: fn(x2d) -> [T, H] to add, or None."""
    kids = [m.get_submodule(n) for n in d["shared_experts"]]
    if not kids:
        return [("none", None)], None
    device, dtype = param_like(m)
    x = probe_input((4, d["hidden"]), device, dtype)
    try:
        with torch.no_grad():
            widths = [c(x).shape[-1] for c in kids]
    except Exception:  # a child that can't run on [T, H]: not a shared expert we can call  # noqa: BLE001
        return [], "shared experts that cannot be called on the tokens"
    full = [c for c, w in zip(kids, widths) if w == d["hidden"]]
    gates = [c for c, w in zip(kids, widths) if w == 1]
    if len(full) + len(gates) != len(kids) or not full:
        return [], "shared children of unrecognised widths"
    cands = [("added", lambda x: sum(c(x) for c in full))]
    if len(gates) == 1 and len(full) == 1:
        g, s = gates[0], full[0]
        cands = [("sigmoid-gated", lambda x: torch.sigmoid(g(x)) * s(x))]
    elif gates:
        return [], "several shared-expert gates"
    return cands, None


# ---------------------------------------------------------------------------------------------
# The fused forward


def _router(m: nn.Module, d: dict):
    owner_name, _, pname = d["router"].rpartition(".")
    owner = m.get_submodule(owner_name) if owner_name else m
    weight = getattr(owner, pname)
    bias = owner.bias if isinstance(owner, nn.Linear) else None
    return weight, bias


def build(m: nn.Module, d: dict, p: dict, reference: bool = False):
    """The fused forward for match params `p` (score, renorm, layout, up_first, shared); with
    `reference`, over the kernels' eager references (the match probe's candidates: the Triton
    interpreter on a CPU costs seconds a candidate)."""
    get = reference_fn if reference else kernel_fn
    route, permute, unpermute, experts = (get(r) for r in (ROUTER, PERMUTE, UNPERMUTE, EXPERTS))
    weight, bias = _router(m, d)
    wfn = dict(_expert_weights(m, d)[0])[p["layout"]]
    shared = dict(_shared(m, d)[0])[p["shared"]]
    k, score, renorm, up_first = d["top_k"], p["score"], p["renorm"], p["up_first"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        r = route(F.linear(h, weight, bias), k, score, renorm)
        xp, pos = permute(h, r.indices, r.offsets)
        gu, dn = wfn()
        yp = experts(xp, r.offsets, _halves(gu, up_first), dn)
        y = unpermute(yp, pos, r.weights)
        if shared is not None:
            y = y + shared(h)
        return y.reshape(shape)

    return forward


# ---------------------------------------------------------------------------------------------
# Match


def _random_in_training(m: nn.Module, x: torch.Tensor) -> bool:
    """The forward gives different outputs for two RNG seeds in training mode (router jitter or
    noise, dropout). Each submodule's mode is put back after; no copy of the block (at Mixtral
    size a copy is gigabytes of expert weights on the GPU). Forked RNG: the script's stream stays."""
    modes = [(c, c.training) for c in m.modules()]
    m.train()
    outs = []
    try:
        for seed in (0, 1):
            with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), probe_mode():
                torch.manual_seed(seed)
                outs.append(m(x.clone()))  # a clone: jitter multiplies its input in place (HF Mixtral)
    finally:
        for c, mode in modes:
            c.training = mode
    return not torch.equal(outs[0], outs[1])


def plan(path: str, m: nn.Module) -> tuple[dict | None, str | None]:
    """(params, None) when the block can be patched; (None, why not) for a recognised MoE block
    that can't; (None, None) when `m` is no MoE block."""
    if moe.structure(m) is None:
        return None, None
    d = moe.match(path, m)
    if d is None:
        return None, None
    if d["group_limited"]:
        g = d["group_limited"]
        return None, (f"group-limited routing (top-{g['groups_kept']} of {g['groups']} expert groups first, "
                      "DeepSeek-V3) is not implemented by the fused router")
    if d["top_k"] > 32:
        return None, f"top-{d['top_k']} routing: the fused router takes k <= 32"
    scores = {"softmax": ["softmax"], "softmax over top-k": ["softmax"], "sigmoid": ["sigmoid"]}.get(d["score"])
    if scores is None:
        return None, f"score function {d['score']!r} (softmax or sigmoid expected)"
    renorms = [True] if d["score"] == "softmax over top-k" else [True, False]
    weights, why = _expert_weights(m, d)
    if why:
        return None, why
    shared, why = _shared(m, d)
    if why:
        return None, why
    device, dtype = param_like(m)
    n = d["num_experts"]
    t = min(max(moe.TOKENS_PER_EXPERT * n, 16), moe.MAX_PROBE_TOKENS)
    x = probe_input((1, t, d["hidden"]), device, dtype)
    if _random_in_training(m, x):
        return None, ("the forward is random in training (router jitter or noise, or dropout); "
                      "the fused path is deterministic")
    cands = {}
    for layout, _ in weights:
        for up_first in (False, True):
            for score in scores:
                for renorm in renorms:
                    for sh, _ in shared:
                        p = {"layout": layout, "up_first": up_first, "score": score, "renorm": renorm, "shared": sh}
                        cands[tuple(p.items())] = build(m, d, p, reference=True)
    best, best_err = None, float("inf")
    for key, fn in cands.items():
        if behaves_like(lambda: m(x), lambda fn=fn: fn(x), dtype):
            e = probe_error(lambda: m(x), lambda fn=fn: fn(x))
            if e < best_err:
                best, best_err = key, e
    if best is None:
        return None, ("the block's output is not top-k routing over SwiGLU experts with a weighted sum "
                      "(non-SwiGLU experts, or another combine)")
    p = dict(best)
    fused = build(m, d, p)  # the kernels themselves, on the same probe and the skewed one below
    if not behaves_like(lambda: m(x), lambda: fused(x), dtype):
        return None, "the fused kernels disagree with the block on the probe (a kernel fault)"
    # Every token alike: all go to the same k experts, so any capacity below T drops tokens.
    same = x[:, :1].expand_as(x).contiguous()
    if not behaves_like(lambda: m(same), lambda: fused(same), dtype):
        return None, "tokens are dropped when an expert overflows (capacity factor); not implemented"
    why = _routing_agrees(m, d, p, x, dtype)
    if why:
        return None, why
    return {**p, "moe": d}, None


def _fused_routing(logits: torch.Tensor, k: int, score: str, renorm: bool):
    """The patched forward's routing (a seam for the tests, which break it on purpose)."""
    return kernel_fn(ROUTER)(logits, k, score, renorm)


def check(m: nn.Module, p: dict, args: tuple, kwargs: dict) -> tuple[bool, str] | None:
    """Rule.check at each verification on the real input: the block's own top-k against the
    fused router's (routing_check), besides the outputs and grads verify_call compares."""
    if "moe" not in p:
        return None
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor):
        return None
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
    why = _routing_agrees(m, p["moe"], p, x.detach(), dtype)
    return (True, "routing agrees where decided") if why is None else (False, why)


def _routing_agrees(m: nn.Module, d: dict, p: dict, x: torch.Tensor, dtype) -> str | None:
    """The block's own top-k against `moe_router` on the same logits (routing_check)."""
    rec = _TopK(d["num_experts"])
    with torch.no_grad():
        with rec:
            m(x)
        if rec.last is None:
            return "the block's top-k over the experts was not seen on the probe"
        scores, w_ref, idx_ref = rec.last
        weight, bias = _router(m, d)
        r = _fused_routing(F.linear(x.reshape(-1, d["hidden"]), weight, bias), d["top_k"], p["score"], p["renorm"])
    if scores.shape[0] != r.indices.shape[0]:
        return None  # a top-k over another layout (e.g. batched): the output probe already agreed
    w_ref = w_ref.float()  # the picked scores; the block's weights follow from them
    if d["score"] == "softmax over top-k":
        w_ref = torch.softmax(w_ref, dim=-1)  # the top-k of the logits, softmaxed after
    elif p["renorm"]:
        w_ref = w_ref / w_ref.sum(-1, keepdim=True)
    ok, what = routing_check(scores, idx_ref, w_ref, r.indices, r.weights, d["top_k"], dtype)
    return None if ok else f"routing differs from the block's own: {what}"


def match(path: str, m: nn.Module) -> dict | None:
    params, why = plan(path, m)
    if why:
        # A recognised block that can't be patched: install.patch reports it as declined.
        return {"declined": why}
    return params


def replace(m: nn.Module, p: dict) -> dict:
    if "declined" in p:
        return {}
    return {"": build(m, p["moe"], p)}


RULE = Rule(
    id=ID,
    title="MoE block -> fused router, permute, grouped SwiGLU experts, unpermute",
    kernels=(ROUTER, PERMUTE, UNPERMUTE, EXPERTS),
    match=match,
    replace=replace,
    # Never matches an op table: the profile side is the `moe_fused` diagnosis (rules/diagnoses/
    # moe.py), which finds MoE blocks from the recorded top-k and routing facts (an own-op pattern
    # would flag every module that calls topk, and HF runs it in the router child, not the block).
    profile=ProfilePattern(own_all=("topk",), own_none=("topk",)),
    check=check,
    change="kprof moe_router + moe_permute + torch._grouped_mm SwiGLU experts + moe_unpermute (no host sync)",
    confidence="medium",
)

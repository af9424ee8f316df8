"""Mixture-of-experts blocks, recognised on the live model by structure and by what their forward
calls (issue 21). No fused MoE patch exists yet: this is the matcher a patch will use, and
`find_moe` reports what a model's MoE blocks are (the profile-side row is the `moe_block`
diagnosis, rules/diagnoses/moe.py).

A block is: a router projection H -> E, a score function (softmax or sigmoid), a top-k over the
E scores, and E per-expert MLPs. Names are never read; shapes are:

1. Structure (no call). The experts are a direct child that is a ModuleList/ModuleDict of >= 2
   modules with identical parameter shapes, or 3-D parameters [E, ., .] of the module itself or
   of one direct child (stacked weights: HF Mixtral, OLMoE, Qwen2-MoE and DeepSeek-V3 in
   transformers 5). The router is a 2-D parameter [E, H] of the module or of a direct child
   outside the experts (an `nn.Linear(H, E)`, or a bare weight as in HF's TopKRouter).
2. Behaviour. The forward runs once on a small random input (no grad, the RNG state restored)
   under a TorchFunctionMode that sees every torch call, as `torch.fx` would but through Python
   control flow (a loop over the experts, `torch.where`, `if rows.numel()`), which symbolic
   tracing cannot follow. It must call topk over the E router scores. From the calls: top-k,
   the score function (softmax/sigmoid before top-k, or softmax over the k picked), group-limited
   routing (a top-k over G | E groups first, DeepSeek-V3), and the dispatch: `grouped_mm` (one
   grouped GEMM), `loop` (one matmul per expert, a Python loop) or `dense` (every expert's
   weights in one batched matmul, masks select the outputs).

Shared experts are the other direct children that hold matmul weights with the hidden size H
(Qwen2-MoE's shared_expert and its sigmoid gate, DeepSeek's shared_experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kprof.rules.engine import param_like, probe_input, probe_mode, source_of

# Probe size: every expert should get tokens so that a loop over the hit experts shows as one
# matmul per expert; 8 tokens per expert with top-1 already hits all 8 of Mixtral's.
TOKENS_PER_EXPERT = 8
MAX_PROBE_TOKENS = 512

_TOPK = {torch.topk, torch.Tensor.topk}
_SCORES = {torch.softmax: "softmax", F.softmax: "softmax", torch.Tensor.softmax: "softmax",
           torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.Tensor.sigmoid: "sigmoid"}
_MATMULS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
            torch.bmm, torch.Tensor.bmm, torch.einsum, torch.addmm, torch.baddbmm}
# Calls whose result is the same weight seen differently (a slice, a transpose, a cast).
_VIEWS = {torch.Tensor.__getitem__, torch.Tensor.transpose, torch.Tensor.t, torch.Tensor.view,
          torch.Tensor.reshape, torch.Tensor.contiguous, torch.Tensor.to, torch.Tensor.type,
          torch.Tensor.float, torch.Tensor.permute, torch.transpose, torch.t}


def _is(func, group) -> bool:
    try:
        return func in group
    except TypeError:  # an unhashable callable
        return False


class _Calls(TorchFunctionMode):
    """Records, in order, the calls that tell an MoE block's routing and dispatch apart; weights
    are followed through views and slices back to their parameter (name, expert index)."""

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.params = params
        self.derived: dict[int, tuple[str, int | None]] = {}  # id(tensor) -> (param, expert)
        self.keep: list = []  # the derived tensors, alive while recorded (ids stay unique)
        self.events: list[tuple] = []

    def _weight(self, t) -> tuple[str, int | None] | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params:
            return self.params[id(t)], None
        return self.derived.get(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is(func, _VIEWS) and args and isinstance(out, torch.Tensor):
            w = self._weight(args[0])
            if w is not None:
                name, expert = w
                if func is torch.Tensor.__getitem__ and expert is None and len(args) > 1:
                    expert = _index(args[1])
                self.derived[id(out)] = (name, expert)
                self.keep.append(out)
        elif _is(func, _TOPK):
            x = args[0]
            k = kwargs.get("k", args[1] if len(args) > 1 else None)
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            self.events.append(("topk", tuple(x.shape), int(k), int(dim) % max(x.dim(), 1)))
        elif _is(func, _SCORES) and args and isinstance(args[0], torch.Tensor):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            dim = dim if isinstance(dim, int) else -1
            self.events.append(("score", _SCORES[func], tuple(args[0].shape), dim % max(args[0].dim(), 1)))
        elif "grouped_mm" in getattr(func, "__name__", "") or "grouped_mm" in str(func):
            self.events.append(("grouped_mm", [w for w in map(self._weight, args) if w]))
        elif _is(func, _MATMULS):
            ws = [w for w in map(self._weight, [*args, *kwargs.values()]) if w]
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            self.events.append(("matmul", ws, shapes, tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
        return out


def _index(i) -> int | None:
    if isinstance(i, int):
        return i
    if isinstance(i, torch.Tensor) and i.numel() == 1 and not i.is_floating_point():
        return int(i.reshape(()))
    if isinstance(i, tuple) and i:
        return _index(i[0])
    return None


def _experts(m: nn.Module) -> tuple[str, int, str] | None:
    """(child name or "", number of experts, "modulelist" | "stacked") from structure alone."""
    for name, c in m.named_children():
        if isinstance(c, (nn.ModuleList, nn.ModuleDict)) and len(c) >= 2:
            kids = list(c.children())
            shapes = [[tuple(p.shape) for p in k.parameters()] for k in kids]
            if all(s == shapes[0] for s in shapes) and sum(len(s) == 2 for s in shapes[0]) >= 2:
                return name, len(kids), "modulelist"
    for name, c in [("", m), *m.named_children()]:
        own = [p for p in c.parameters(recurse=False) if p.dim() == 3]
        if own and len({p.shape[0] for p in own}) == 1 and own[0].shape[0] >= 2:
            return name, int(own[0].shape[0]), "stacked"
    return None


def _router(m: nn.Module, experts: str, n: int) -> tuple[str, int] | None:
    """(parameter name, hidden size H) of a 2-D [E, H] weight outside the experts: in the module
    or in one of its direct children."""
    for pname, p in m.named_parameters():
        parts = pname.split(".")
        if len(parts) > 2 or (experts and parts[0] == experts) or p.dim() != 2:
            continue
        if p.shape[0] == n and p.shape[1] > 1:
            return pname, int(p.shape[1])
    return None


def structure(m: nn.Module) -> dict | None:
    """The structural half of `match`: experts and router, or None."""
    ex = _experts(m)
    if ex is None:
        return None
    name, n, kind = ex
    r = _router(m, name, n)
    if r is None:
        return None
    return {"experts": name, "num_experts": n, "expert_storage": kind, "router": r[0], "hidden": r[1]}


def _probe(m: nn.Module, hidden: int, n: int) -> _Calls | None:
    device, dtype = param_like(m)
    t = min(max(TOKENS_PER_EXPERT * n, 16), MAX_PROBE_TOKENS)
    params = {id(p): name for name, p in m.named_parameters()}
    for shape in ((1, t, hidden), (t, hidden)):
        rec = _Calls(params)
        try:
            # The probe must not move the script's random stream (router jitter, dropout).
            with torch.random.fork_rng(devices=[]), probe_mode(), rec:
                m(probe_input(shape, device, dtype))
        except Exception:  # a shape the forward refuses: try the next  # noqa: BLE001
            continue
        return rec
    return None


def match(path: str, m: nn.Module) -> dict | None:
    """The MoE block's description if `m` is one, else None (see the module docstring):
    num_experts, top_k, score ("softmax", "sigmoid", "softmax over top-k"), group_limited
    (None or {"groups", "groups_kept"}), shared_experts (child names), dispatch ("grouped_mm",
    "loop", "dense"), experts, router, expert_storage, hidden, source (file:line)."""
    st = structure(m)
    if st is None:
        return None
    n = st["num_experts"]
    rec = _probe(m, st["hidden"], n)
    if rec is None:
        return None
    ev = rec.events
    picks = [(i, e) for i, e in enumerate(ev) if e[0] == "topk" and e[1][e[3]] == n and e[2] < n]
    if not picks:
        return None  # no top-k over the E router scores: a dense mixture, not routed
    at, top = picks[-1]
    k = top[2]
    score = None
    for e in ev[:at]:
        if e[0] == "score" and e[2][e[3]] == n:
            score = e[1]
    if score is None and any(e[0] == "score" and e[1] == "softmax" and e[2][e[3]] == k for e in ev[at + 1:]):
        score = "softmax over top-k"
    groups = [e for e in ev[:at] if e[0] == "topk" and len(e[1]) == len(top[1]) and e[1][e[3]] < n
              and n % e[1][e[3]] == 0]
    group_limited = {"groups": groups[-1][1][groups[-1][3]], "groups_kept": groups[-1][2]} if groups else None

    ex = st["experts"]
    prefix = ex + "." if ex else ""

    def expert_of(w: tuple[str, int | None]) -> int | str | None:
        name, idx = w
        if st["expert_storage"] == "modulelist":
            if not name.startswith(prefix):
                return None
            return name[len(prefix):].split(".")[0]
        p = dict(m.named_parameters()).get(name)
        if p is None or p.dim() != 3 or (ex and not name.startswith(prefix)):
            return None
        return idx if idx is not None else "all"

    grouped = any(e[0] == "grouped_mm" for e in ev)
    used = [expert_of(w) for e in ev if e[0] == "matmul" for w in e[1]]
    used = [u for u in used if u is not None]
    if grouped:
        dispatch = "grouped_mm"
    elif "all" in used:
        dispatch = "dense"
    elif len(set(used)) >= 2:
        dispatch = "loop"
    else:
        return None  # the experts' weights never reached a matmul: not this pattern
    shared = []
    for name, c in m.named_children():
        if name == ex or st["router"].split(".")[0] == name:
            continue
        if any(p.dim() == 2 and st["hidden"] in p.shape for p in c.parameters()):
            shared.append(name)
    return {**st, "top_k": k, "score": score or "none", "group_limited": group_limited,
            "shared_experts": shared, "dispatch": dispatch, "source": source_of(m), "path": path}


def find_moe(model: nn.Module) -> list[dict]:
    """Every MoE block in `model` (outermost first; nothing inside a matched block is searched)."""
    out: list[dict] = []
    inside: list[str] = []
    for path, mod in model.named_modules():
        if any(p == "" or path.startswith(p + ".") for p in inside):
            continue
        d = match(path, mod)
        if d is not None:
            out.append(d)
            inside.append(path)
    return out

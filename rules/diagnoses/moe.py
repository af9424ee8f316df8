"""Mixture-of-experts blocks in a profile (issue 21): the block itself, host syncs in its routing,
expert load imbalance and a Python loop over the experts; and the fused MoE patch
(kprof.rules.moe_fused) as an apply-able row for the blocks it can patch, so that
`kprof apply --patch moe_fused` finds it in the plan.

Recognition, from the run alone (the live-model matcher is kprof.rules.moe): the shapes step
records every `topk` with the module that ran it, the line that called it and how often each of
its n choices was picked (summary["routing"], kprof/capture/syncs.py). A routing record is a
router when 2 <= k < n <= MAX_EXPERTS and a forward matmul of the block has n as a dimension
(the router projection H -> n). The block is the router's module, or its nearest ancestor whose
subtree runs matmuls outside the router (HF: `mlp.gate` runs the top-k, `mlp` holds the experts).
Dispatch: `grouped_mm` if the block runs `_grouped_mm`; `dense` if a bmm batches n experts;
otherwise `loop` (per-expert matmuls). Group-limited routing shows as a second top-k record of
the same module over G | n groups.
"""

from __future__ import annotations

import ast
import math
import os
from functools import lru_cache

import numpy as np
import pandas as pd

from kprof.analyze.costmodel import Cost
from kprof.analyze.modules import MATMUL_OPS, group_paths, hits, op_base, roofline_us
from kprof.rules.diagnoses.base import Diagnosis, Finding, n_steps
from kprof.rules.diagnoses.manual_attention import arg_shapes
from kprof.rules.moe_fused import ID as PATCH_ID

MAX_EXPERTS = 4096  # above this a top-k is over a vocabulary (top-5 accuracy), not experts
# Imbalance worth a finding: the busiest expert at 1.5x the mean load. Top-2 of 8 with a router
# that sends every token to one expert is 4x; a fresh router on random data is ~1.2-1.4x
# (the planted and HF runs of tests/diagnoses_scripts).
IMBALANCE_RATIO = 1.5
IMBALANCE_SD = 4.0
_GEMM = tuple(MATMUL_OPS) + ("grouped_mm",)


def _fwd(ops: pd.DataFrame) -> pd.DataFrame:
    return ops[ops["phase"] == "fwd"] if "phase" in ops else ops


def _under(mods: pd.Series, path: str) -> pd.Series:
    return (mods == path) | mods.str.startswith(path + ".") if path else mods != ""


def blocks(ops: pd.DataFrame, summary: dict) -> list[dict]:
    """The MoE blocks of a run, one dict each: path, router (module running the top-k),
    num_experts, top_k, score, group_limited, shared_experts, experts (child paths), dispatch,
    counts (tokens per expert in the shapes step), source (file:line of the top-k)."""
    recs = summary.get("routing") or []
    if ops is None or not len(ops) or not recs:
        return []
    fwd = _fwd(ops)
    names = op_base(fwd["op"])
    mm = fwd[hits(names, _GEMM).to_numpy()]
    mm_mods = mm["module"].astype(str)
    by_mod: dict[str, dict] = {}
    for r in recs:  # the widest top-k of a module is its expert choice (DeepSeek: groups first)
        if by_mod.get(r["module"], {}).get("choices", 0) < r["choices"]:
            by_mod[r["module"]] = r
    out = []
    for router, r in by_mod.items():
        n, k = int(r["choices"]), int(r["k"])
        if not (1 <= k < n <= MAX_EXPERTS):
            continue
        path = router
        while True:
            inside = mm_mods[_under(mm_mods, path)]
            if (inside != router).any() or path == "":
                break
            path = path.rsplit(".", 1)[0] if "." in path else ""
        sub = mm[_under(mm_mods, path).to_numpy()]
        if not any(s and n in s for shapes in sub["input_shapes"] for s in arg_shapes(shapes)):
            continue  # no router projection to n outputs in the block
        groups = [g for g in recs if g["module"] == router and g["choices"] < n and n % g["choices"] == 0]
        # The score is the router's (its subtree, or the block's own ops when the block runs the
        # top-k itself): Qwen2-MoE's shared-expert gate is a sigmoid beside a softmax router.
        mods_f = fwd["module"].astype(str)
        own = set(op_base(fwd.loc[(mods_f == path) if router == path else _under(mods_f, router), "op"]))
        score = "sigmoid" if "sigmoid" in own else "softmax" if own & {"softmax", "log_softmax"} else "none"
        subn = op_base(sub["op"])
        if (subn == "grouped_mm").any():
            dispatch = "grouped_mm"
        elif any(s and s[0] == n and len(s) == 3 for o, sh in zip(subn, sub["input_shapes"]) if o in ("bmm", "baddbmm")
                 for s in arg_shapes(sh)[:1]):
            dispatch = "dense"
        else:
            dispatch = "loop"
        # Children of the block: the router's, the experts' (most matmuls), the others are shared.
        kids: dict[str, int] = {}
        projections = set()  # children running the router projection (a matmul with n outputs)
        for mod, shapes in zip(sub["module"].astype(str), sub["input_shapes"]):
            if mod == path or _under(pd.Series([router]), mod).iloc[0]:
                continue
            kid = path + "." + mod[len(path) + 1:].split(".")[0] if path else mod.split(".")[0]
            kids[kid] = kids.get(kid, 0) + 1
            if router == path and any(s and s[0] == n and len(s) == 2 for s in arg_shapes(shapes)[1:2]):
                projections.add(kid)
        kids = {c: v for c, v in kids.items() if c not in projections}
        experts = max(kids, key=kids.get) if kids else ""
        shared = sorted(c for c in kids if c != experts)
        counts = list(r.get("counts") or [])
        out.append({"path": path, "router": router, "num_experts": n, "top_k": k, "score": score,
                    "group_limited": ({"groups": groups[-1]["choices"], "groups_kept": groups[-1]["k"]}
                                      if groups else None),
                    "shared_experts": shared, "experts": experts, "dispatch": dispatch,
                    "counts": counts, "source": r.get("source") or ""})
    return out


def static_dims(ops: pd.DataFrame, summary: dict) -> dict[str, set[int]]:
    """{expert subtree path: the dims of its weights}. Any other dim of a matmul there counts
    tokens routed to one expert: data-dependent, so no padding advice applies to it (the weights
    are the second input of the forward aten::linear rows, or the 3-D operand of a grouped GEMM)."""
    out: dict[str, set[int]] = {}
    if ops is None or not len(ops):
        return out
    fwd = _fwd(ops)
    names = op_base(fwd["op"])
    mods = fwd["module"].astype(str)
    for b in blocks(ops, summary):
        root = b["experts"] or b["path"]
        sel = _under(mods, root) & (mods != b["router"]) & names.isin(["linear", "grouped_mm"])
        dims: set[int] = set()
        for shapes in fwd.loc[sel.to_numpy(), "input_shapes"]:
            for w in arg_shapes(shapes)[1:2]:
                dims.update(w[-2:] if w else ())
        out[root] = dims
    return out


def _ms(ops: pd.DataFrame, sel, summary: dict) -> float:
    t = pd.to_numeric(ops.loc[sel, "device_time (us)"], errors="coerce").fillna(0).sum()
    return float(t) / n_steps(ops, summary) / 1e3


def _short(src: str) -> str:
    file, _, line = src.rpartition(":")
    return f"{os.path.basename(file)}:{line}" if file else src


def _where(bs: list[dict]) -> str:
    return ", ".join(f"{g} x {c}" if c > 1 else g or "<model>" for g, c in group_paths([b["path"] for b in bs]))


def _advice(dispatch: str) -> str:
    if dispatch == "loop":
        return ("dispatch all experts at once: stack the expert weights [E, ...], order tokens by "
                "expert (argsort of the top-k ids), counts with bincount(minlength=E) or histc, "
                "offsets = cumsum(counts), then torch._grouped_mm(x, w, offs=offs)")
    if dispatch == "dense":
        return ("every expert runs every token: compute only the routed (token, expert) pairs "
                "with torch._grouped_mm on expert-sorted tokens")
    return ("fuse routing (softmax/sigmoid + top-k + counts) and the permutation around the "
            "grouped GEMM, or torch.compile the block")


_PATCH_NOTE = (" (verified at its first call, routing included; on the live model it declines, with the reason, "
               "experts that are not SwiGLU, token dropping and router noise in training)")


def _why_not(b: dict) -> str | None:
    """Why the fused patch can't take this block, as far as the profile shows; None: it may."""
    if b.get("group_limited"):
        return "group-limited routing (DeepSeek-V3) is not implemented"
    if b.get("score") not in ("softmax", "sigmoid", "softmax over top-k"):
        return f"score function {b.get('score')!r}"
    return None


def _patchable(b: dict) -> bool:
    return _why_not(b) is None


def _patch_first(bs: list[dict]) -> str:
    return f"kprof apply --patch {PATCH_ID} removes them, or in the code: " if any(map(_patchable, bs)) else ""


def _block_rows(ops: pd.DataFrame, bs: list[dict]) -> np.ndarray:
    """The forward and backward op rows under any of the blocks `bs`."""
    mods = ops["module"].astype(str)
    sel = np.zeros(len(ops), dtype=bool)
    for b in bs:
        sel |= _under(mods, b["path"]).to_numpy()
    if "phase" in ops:
        sel &= ops["phase"].isin(["fwd", "bwd"]).to_numpy()
    return sel


def _fused_find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    """The apply-able row: the blocks the fused patch may take (the live match decides)."""
    bs = [b for b in blocks(ops, summary) if _patchable(b)]
    if not bs:
        return []
    sel = _block_rows(ops, bs)
    return [Finding(
        where=_where(bs), evidence=f"{len(bs)} MoE block(s) with {bs[0]['score']} top-{bs[0]['top_k']} routing, "
                                   f"dispatch: {bs[0]['dispatch']}",
        change="kprof moe_router + moe_permute + torch._grouped_mm SwiGLU experts + moe_unpermute, no host sync",
        how=f"kprof apply --patch {PATCH_ID}{_PATCH_NOTE}",
        ms_per_step=_ms(ops, sel, summary), saving_note="no estimate: kprof apply measures the step before and after",
        source=bs[0]["source"], paths=[b["path"] for b in bs], cls="moe", confidence="medium", details=bs,
        applyable=True)]


def _block_find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    bs = blocks(ops, summary)
    if not bs:
        return []
    sel = _block_rows(ops, bs)
    b0 = bs[0]
    desc = (f"{b0['num_experts']} experts, top-{b0['top_k']}, {b0['score']} scores"
            + (f", group-limited ({b0['group_limited']['groups_kept']} of {b0['group_limited']['groups']} groups)"
               if b0["group_limited"] else "")
            + (f", shared: {', '.join(s.rsplit('.', 1)[-1] for s in b0['shared_experts'])}"
               if b0["shared_experts"] else "")
            + f", dispatch: {b0['dispatch']}")
    ms = _ms(ops, sel, summary)
    return [Finding(
        where=_where(bs), evidence=f"{len(bs)} MoE block(s), {ms:.1f} ms/step fwd+bwd; {desc}; "
                                   f"routing at {_short(b0['source'])}",
        change="fused MoE path: router kernel, permute/unpermute, grouped GEMM",
        how=(f"kprof apply --patch {PATCH_ID}{_PATCH_NOTE}; or in the code: {_advice(b0['dispatch'])}"
             if _patchable(b0) else f"no fused MoE patch: {_why_not(b0)}; in the code: {_advice(b0['dispatch'])}"),
        ms_per_step=ms, saving_note="no MoE patch to estimate against yet", source=b0["source"],
        paths=[b["path"] for b in bs], cls="moe", confidence="high", details=bs)]


@lru_cache(maxsize=64)
def _classes_at(file: str) -> tuple[tuple[str, int, int], ...]:
    """(class name, first line, last line) of each class in a source file."""
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    return tuple((n.name, n.lineno, n.end_lineno or n.lineno) for n in ast.walk(tree) if isinstance(n, ast.ClassDef))


def _site(s: dict) -> tuple[str, int]:
    """The sync's line in the code that ran it: the library line (`via`) when the script's
    line is only the call into a library (HF's experts loop), else the script's line."""
    via = s.get("via")
    if via:
        file, _, line = str(via).rpartition(":")
        if line.isdigit():
            return file, int(line)
    return str(s.get("file")), int(s.get("line") or 0)


def _sync_find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    bs = blocks(ops, summary)
    syncs = [s for s in summary.get("syncs") or [] if int(s.get("count") or 0) > 0]
    if not bs or not syncs:
        return []
    classes = summary.get("module_classes") or {}
    in_block = {c for p, c in classes.items() for b in bs if _under(pd.Series([p]), b["path"]).iloc[0]}
    n = int(summary.get("sync_steps") or 0) or n_steps(ops, summary)
    hits_ = []
    for s in syncs:
        file, line = _site(s)
        owner = [c for c, a, z in _classes_at(file) if a <= line <= z]
        if owner and owner[-1] in in_block:
            hits_.append((s, file, line))
    if not hits_:
        return []
    hits_.sort(key=lambda h: -int(h[0]["count"]))
    per_step = sum(int(s["count"]) for s, _, _ in hits_) / n
    lines = [f"{s['kind']} x{int(s['count']) / n:g}/step at {os.path.basename(f)}:{ln}" for s, f, ln in hits_[:3]]
    s0, f0, l0 = hits_[0]
    return [Finding(
        where="\n".join(f"{os.path.basename(f)}:{ln}" for _, f, ln in hits_[:3]),
        evidence=f"{per_step:g} host syncs per step in MoE routing/dispatch:\n" + "\n".join(lines),
        change="route without reading counts back: torch.where(cond, a, b) or masked ops for masks, "
               "bincount/histc + cumsum offsets on the device, one grouped GEMM over all experts",
        how=f"{os.path.basename(f0)}:{l0}: {_patch_first(bs)}drop the data-dependent shape "
            "(nonzero / one-argument torch.where / boolean indexing / .item() / .tolist()) and "
            "the per-expert `if rows.numel()` that follows it",
        saving_note="counted in host_sync's GPU-idle bound", source=f"{f0}:{l0}",
        paths=[f"{f}:{ln}" for _, f, ln in hits_], cls="host sync", confidence="high",
        details=[{"file": f, "line": ln, "kind": s["kind"], "per step": int(s["count"]) / n} for s, f, ln in hits_])]


def expert_gemms(ops: pd.DataFrame, b: dict) -> pd.DataFrame:
    """The block's expert matmul rows (fwd and bwd), kernel-level (mm/bmm/addmm/grouped_mm)."""
    mods = ops["module"].astype(str)
    sel = _under(mods, b["experts"]) if b["experts"] else _under(mods, b["path"]) & (mods != b["router"])
    names = op_base(ops["op"])
    sel &= hits(names, ("mm", "addmm", "bmm", "baddbmm", "grouped_mm")) & ~names.isin(["matmul", "linear"])
    if "phase" in ops:
        sel &= ops["phase"].isin(["fwd", "bwd"])
    return ops[sel.to_numpy()]


def _beyond_chance(counts: list[int]) -> bool:
    """The busiest expert's excess is more than a uniform router's noise: a count is about
    Poisson(mean), and the largest of E <= 256 such counts is within ~3 sd of the mean, so 4 sd
    (64 tokens on 8 experts: max - mean > 16 tokens) keeps a fresh router on few tokens quiet."""
    c = np.asarray(counts, dtype=float)
    return bool(c.max() - c.mean() > IMBALANCE_SD * math.sqrt(max(c.mean(), 1.0)))


def _imbalance_find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    out, rows = [], []
    for b in blocks(ops, summary):
        c = np.asarray(b["counts"], dtype=float)
        if c.sum() <= 0:
            continue
        ratio = float(c.max() / c.mean())
        g = expert_gemms(ops, b)
        ms = _ms(ops, g.index, summary) if len(g) else math.nan
        # Experts run side by side (expert parallelism, or a grouped GEMM's tiles over the SMs)
        # finish when the busiest one does: above the balanced load, max - mean of every
        # expert's share of the GEMM time is waiting.
        wasted = ms * (1 - c.mean() / c.max()) if math.isfinite(ms) else math.nan
        rows.append({"block": b["path"], "tokens per expert": [int(x) for x in c], "max/mean": ratio,
                     "busiest": int(c.argmax()), "expert GEMM ms/step": ms, "wasted ms/step": wasted,
                     "source": b["source"]})
    bad = [r for r in rows if r["max/mean"] >= IMBALANCE_RATIO and _beyond_chance(r["tokens per expert"])]
    if not bad:
        return out
    worst = max(bad, key=lambda r: r["max/mean"])
    wasted = sum(r["wasted ms/step"] for r in bad if math.isfinite(r["wasted ms/step"]))
    lines = [f"{r['block']}: max/mean {r['max/mean']:.2f} (expert {r['busiest']}), tokens "
             f"{r['tokens per expert']}" for r in bad[:3]]
    out.append(Finding(
        where=_where([{"path": r["block"]} for r in bad]),
        evidence="expert load in the shapes step:\n" + "\n".join(lines)
                 + f"\nexpert GEMMs waiting on the busiest expert: {wasted:.2f} ms/step",
        change="balance the router: auxiliary load-balancing loss (Switch/Mixtral "
               "router_aux_loss_coef), or DeepSeek-style bias updates on the expert scores",
        how=f"{_short(worst['source'])}: add a load-balancing loss "
            "on the router's scores (output_router_logits=True in HF MoE configs)",
        ms_per_step=sum(r["expert GEMM ms/step"] for r in bad if math.isfinite(r["expert GEMM ms/step"])),
        saving_ms=wasted, saving_note="upper bound: expert GEMM time x (1 - mean/max load), the wait on the "
                                      "busiest expert when experts run in parallel; a loop on one device "
                                      "does the same FLOPs either way",
        source=worst["source"], paths=[r["block"] for r in bad], cls="moe imbalance", confidence="low",
        details=rows))
    return out


def _loop_find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    n = n_steps(ops, summary)
    ceil = summary.get("ceilings") or {}
    rows = []
    for b in blocks(ops, summary):
        if b["dispatch"] != "loop":
            continue
        g = expert_gemms(ops, b)
        if len(g) < 2 * 3:  # fewer than two experts' worth of (gate, up, down) matmuls
            continue
        flops = float(pd.to_numeric(g["flops"], errors="coerce").fillna(0).sum()) / n
        nbytes = float(pd.to_numeric(g["bytes"], errors="coerce").fillna(0).sum()) / n
        ms = _ms(ops, g.index, summary)
        # One grouped GEMM per weight and pass replaces the loop: 3 forward (gate, up, down) and
        # 6 backward (dX and dW of each), each at least one launch latency.
        t = roofline_us(Cost(flops, nbytes), ceil, "bf16") if ceil else math.nan
        grouped = max(t, 9 * float(ceil.get("latency_us") or 0.0)) / 1e3
        rows.append({"block": b["path"], "expert matmuls/step": len(g) / n, "ms/step": ms,
                     "us per matmul": ms * 1e3 / (len(g) / n), "grouped GEMM ms/step": grouped,
                     "source": b["source"]})
    if not rows:
        return []
    ms = sum(r["ms/step"] for r in rows)
    grouped = sum(r["grouped GEMM ms/step"] for r in rows)
    saving = max(ms - grouped, 0.0) if math.isfinite(grouped) else math.nan
    r0 = rows[0]
    return [Finding(
        where=_where([{"path": r["block"]} for r in rows]),
        evidence=f"{sum(r['expert matmuls/step'] for r in rows):g} per-expert matmuls/step in "
                 f"{len(rows)} block(s), {r0['us per matmul']:.1f} us each; {ms:.1f} ms/step",
        change="one grouped GEMM per weight instead of a Python loop over the experts",
        how=f"{_short(r0['source'])}: {_patch_first(blocks(ops, summary))}{_advice('loop')}",
        ms_per_step=ms, saving_ms=saving,
        saving_note="measured expert matmul time - the same FLOPs/bytes as 9 grouped GEMMs "
                    "(3 fwd, 6 bwd) at this run's roofline",
        source=r0["source"], paths=[r["block"] for r in rows], cls="launch-bound", confidence="medium",
        details=rows)]


BLOCK = Diagnosis(id="moe_block", title="mixture-of-experts block", find=_block_find)
ROUTING_SYNC = Diagnosis(id="moe_routing_sync", title="host syncs in MoE routing", find=_sync_find)
IMBALANCE = Diagnosis(id="moe_imbalance", title="expert load imbalance", find=_imbalance_find)
EXPERT_LOOP = Diagnosis(id="moe_expert_loop", title="Python loop over experts (launch-bound)", find=_loop_find)
FUSED = Diagnosis(id=PATCH_ID, title="fused MoE path: router, permute, grouped SwiGLU experts, unpermute",
                  find=_fused_find)
DIAGNOSES = [BLOCK, FUSED, ROUTING_SYNC, IMBALANCE, EXPERT_LOOP]

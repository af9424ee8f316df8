"""Attention written out by hand (q @ k^T, scale, mask, softmax, @ v) -> F.scaled_dot_product_attention.

Eager attention materialises the (B, H, Sq, Sk) scores and reads/writes them several times
forward (matmul, scale, mask, softmax, matmul) and again backward; SDPA's flash /
memory-efficient kernels keep them on chip. Causal 4 x 32 x 4096 x 128 bf16 on an H200,
forward+backward: 64.5 ms by hand vs 4.1 ms through SDPA (measured 2026-11-29, issue 6).

The kernel rules in rules/attention.py already suggest SDPA for modules whose own ops hold the
softmax and the matmuls and that have 1-2 (nanoGPT, patchable) or >= 3 (code change) Linear
children. This diagnosis finds the same computation from the op shapes alone, so it also sees
attention the rules can't name: projections held as raw Parameters, attention inline in a block
or model forward, the softmax in an nn.Softmax child. Modules a rule matched are left to the rule
(`kprof suggest` shows its row): no suggestion is made twice.

Evidence, per recorded step, forward ops in call order (each top-level call with the ops nested
in it; on a GPU a call's copy kernels are joined to the matmul kernel that follows them):
  1. a matmul (mm/bmm under matmul/einsum/...) [b, Sq, D] x [b, D, Sk] -> scores [b, Sq, Sk],
  2. then, with no other matmul in between, a softmax over the last dim of a [.., Sq, Sk] tensor
     with b rows of Sq x Sk,
  3. then the next matmul [b, Sq, Sk] x [b, Sk, Dv].
The measured time is those calls, the calls between them that touch a [.., Sq, Sk] tensor (scale,
mask, dropout, casts: the (Sq, Sk) trailing dims, b or 1 leading), and in the backward of the same
module every op whose input or matmul output is a full b x Sq x Sk tensor (the four gradient
matmuls, softmax backward, mask and scale backward). The copies a matmul call makes of a non-contiguous
q/k/v count with it (SDPA takes such views as they are). Not counted: `.contiguous()` calls of
their own, mask construction on smaller tensors and the copies' backward (SDPA removes them too,
so the saving is, if anything, understated).

Causal: assumed when a mask in the chain is square (Sq == Sk) and broadcast over batch and heads
(leading dims 1, e.g. nanoGPT's `bias[:, :, :T, :T]`), or the module's forward calls tril/triu.
Anything else is costed as full attention, which only lowers the estimated saving.

Saving: measured time - SDPA's roofline time for the same shapes, both forward+backward per step.
SDPA model (FlashAttention-2 paper, sec. 3.1; the same as rules/attention.py's cost): forward
2 matmuls, 2*b*Sq*Sk*(D + Dv) FLOPs (= 4*b*S^2*D for Sq = Sk, D = Dv); backward 5 matmuls,
2.5x forward, so fwd+bwd is 3.5x forward; halved when causal (masked tiles skipped); at the
run's matmul peak for the dtype (summary ceilings peak_tflops: bf16/fp16, else fp32 or tf32),
and no less than the bytes of q, k, v, o (forward) and of q, k, v, o, dO, dQ, dK, dV (backward)
at the run's bandwidth, at least one launch latency per pass. Check against the reference case
above: 4*128*4096^2*128/2 = 5.5e11 FLOPs forward, 1.9e12 fwd+bwd, at the H200's bf16 peak of
624-750 TFLOP/s (the calibrations in benchmarks/results and fp32_matmul.py) = 3.1-2.6 ms
predicted vs 4.1 ms measured for SDPA, so the saving estimate (61.4-61.9 ms) overstates the
measured 60.4 ms by 2-2.5%.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pandas as pd

from kprof.rules import edits
from kprof.rules.diagnoses.base import Diagnosis, Finding, n_steps, site, step_ms
from kprof.rules.edits import no_diff

# Kernel-level matmul rows: their shapes are the flattened (b, M, K) x (b, K, N) the GPU runs.
MATMUL_ROWS = ("mm", "bmm", "addmm", "baddbmm")
SOFTMAX = ("softmax", "safe_softmax")
# Calls whose nested bmm/softmax are SDPA's own (its math backend): never hand-written.
SDPA_CALLS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
CAUSAL_OPS = ("tril", "triu", "tril_", "triu_")
# Top-level calls allowed between the scores matmul and the second matmul before a candidate is
# dropped: a CPU profile has ~5 (scale, mask view, mask, softmax, dropout) plus views and casts;
# 64 leaves room for code that rebuilds its mask each call, and keeps unrelated code from joining.
MAX_GAP = 64
# Below this share of the step, the saving is within the run-to-run spread of a step
# (~1-3% on the H200 runs in benchmarks/results), as in fp32_matmul.py.
MIN_SAVING_PCT = 1.0
_ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4, "fp64": 8}


def base_name(name) -> str:
    return str(name).rsplit("::", 1)[-1].lstrip("_")


def arg_shapes(v) -> list:
    """input_shapes -> list of per-argument shapes (tuples of ints; () for non-tensors; a
    TensorList argument becomes None)."""
    out = []
    for a in list(v) if v is not None else []:
        try:
            out.append(tuple(int(d) for d in a))
        except (TypeError, ValueError):
            out.append(None)
    return out


def mm_dims(op: str, shapes: list) -> tuple[int, int, int, int] | None:
    """(b, M, K, N) of a kernel-level matmul row from its recorded shapes, else None."""
    base = base_name(op)
    if base not in MATMUL_ROWS:
        return None
    args = [s for s in shapes if s]
    if base in ("addmm", "baddbmm"):
        args = args[1:] if len(args) >= 3 else args
    if len(args) < 2:
        return None
    a, b = args[0], args[1]
    if base in ("mm", "addmm") and len(a) == 2 and len(b) == 2:
        return 1, a[0], a[1], b[1]
    if base in ("bmm", "baddbmm") and len(a) == 3 and len(b) == 3:
        return a[0], a[1], a[2], b[2]
    return None


def _softmax_dim_is_last(concrete, ndim: int) -> bool:
    """softmax(self, dim, ...): dim from the recorded concrete inputs; unknown counts as last."""
    vals = list(concrete) if concrete is not None else []
    if len(vals) < 2 or vals[1] in ("", None):
        return True
    try:
        d = int(vals[1])
    except (TypeError, ValueError):
        return True
    return d in (-1, ndim - 1)


def _common_ancestor(paths) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


class _Sig:
    """A tensor of the scores' family: trailing dims (Sq, Sk) or (Sk, Sq), b (or, unless strict,
    1: a broadcast mask) leading. Backward matching is strict: a [C, C] weight gradient has the
    trailing dims of the scores whenever C == S (4096 and 4096 in the reference case)."""

    def __init__(self, b: int, sq: int, sk: int, strict: bool = False):
        self.b, self.sq, self.sk, self.strict = b, sq, sk, strict

    def __call__(self, s) -> bool:
        if not s or len(s) < 2 or (s[-2], s[-1]) not in ((self.sq, self.sk), (self.sk, self.sq)):
            return False
        lead = math.prod(s[:-2])
        return lead == self.b or (lead == 1 and not self.strict)

    def broadcast_square(self, s) -> bool:
        return bool(s) and len(s) >= 2 and self.sq == self.sk and self(s) and math.prod(s[:-2]) == 1 < self.b


def _units(op: list[str], called: list[str], ids: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Row -> its call: the op_id of the outermost enclosing row. GPU tables have rows only for
    ops that launch kernels, so one composite call (matmul) can show as a copy_ row and a bmm row,
    both top-level: a non-matmul row whose called_op is a matmul-like call joins the next
    top-level matmul row of the same call."""
    parent_of = {i: p for i, p in zip(ids.tolist(), parents.tolist()) if i >= 0}
    present = set(parent_of)

    def root(i):
        for _ in range(32):  # op nesting depth is < 10 in practice
            p = parent_of.get(i, -1)
            if p < 0 or p not in present:
                return i
            i = p
        return i

    # Rows that are no op (a kernel launched outside any op: op_id -1) are calls of their own.
    unit = np.array([root(i) if i >= 0 else -2 - k for k, i in enumerate(ids.tolist())], dtype=np.int64)
    pending: list[int] = []
    for k in range(len(ids)):
        if unit[k] != ids[k]:
            continue  # nested in another row
        if op[k] in MATMUL_ROWS:
            for j in pending:
                if called[j] == called[k]:
                    unit[j] = unit[k]
            pending = []
        elif called[k] in ("matmul", "einsum", "linear", "tensordot") and op[k] != called[k]:
            pending.append(k)
        else:
            pending = []
    return unit


def find_chains(ops: pd.DataFrame) -> list[dict]:
    """Every hand-written attention in the forward: one dict per (step, occurrence) with its
    shapes, module and the forward rows (index labels) it covers."""
    need = {"step", "phase", "op", "input_shapes", "module", "op_id", "parent_id"}
    if ops is None or not len(ops) or not need <= set(ops.columns):
        return []
    fwd = ops[(ops["phase"] == "fwd") & ~ops["module"].isin(["<optimizer>", "<unattributed>"])]
    if not len(fwd):
        return []
    fwd = fwd.sort_values(["step", "ts (us)"] if "ts (us)" in fwd else ["step"], kind="stable")
    op = [base_name(o) for o in fwd["op"]]
    called = [base_name(c) for c in (fwd["called_op"].fillna(fwd["op"]) if "called_op" in fwd else fwd["op"])]
    shapes = [arg_shapes(s) for s in fwd["input_shapes"]]
    dims = [mm_dims(o, s) for o, s in zip(op, shapes)]
    module = fwd["module"].astype(str).tolist()
    steps = fwd["step"].tolist()
    concrete = fwd["concrete_inputs"].tolist() if "concrete_inputs" in fwd else [None] * len(fwd)
    dcls = fwd["dtype class"].tolist() if "dtype class" in fwd else ["fp32"] * len(fwd)
    unit = _units(op, called, pd.to_numeric(fwd["op_id"], errors="coerce").fillna(-1).astype(np.int64).to_numpy(),
                  pd.to_numeric(fwd["parent_id"], errors="coerce").fillna(-1).astype(np.int64).to_numpy())
    # Calls in order of first appearance, per step: [positions].
    calls: dict[tuple, list[int]] = {}
    for k in range(len(op)):
        calls.setdefault((steps[k], int(unit[k])), []).append(k)

    chains, cand = [], None
    for (step, _), pos in calls.items():
        if cand is not None and cand["step"] != step:
            cand = None
        top = pos[0]
        if any(s in called[top] for s in SDPA_CALLS):
            cand = None
            continue
        d = next((dims[k] for k in pos if dims[k]), None)
        if d is not None:
            b, m, k_, n = d
            if cand and cand["softmax"] is not None and (b, m, k_) == (cand["b"], cand["sq"], cand["sk"]):
                chains.append(cand | {"dv": n, "pv": pos})
                cand = None
            else:
                cand = {"step": step, "b": b, "sq": m, "d": k_, "sk": n, "scores": pos, "softmax": None, "between": []}
            continue
        if cand is None:
            continue
        if len(cand["between"]) >= MAX_GAP:
            cand = None
            continue
        s0 = shapes[top][0] if shapes[top] else None
        if (cand["softmax"] is None and op[top] in SOFTMAX and s0 and len(s0) >= 2
                and s0[-2:] == (cand["sq"], cand["sk"]) and math.prod(s0[:-2]) == cand["b"]
                and _softmax_dim_is_last(concrete[top], len(s0))):
            cand["softmax"] = pos
        else:
            cand["between"].append(pos)

    out = []
    labels = fwd.index
    tril_at = {(steps[k], module[k]) for k in range(len(op)) if op[k] in CAUSAL_OPS}
    for c in chains:
        sig = _Sig(c["b"], c["sq"], c["sk"])
        rows = c["scores"] + c["softmax"] + c["pv"]
        causal = False
        for pos in c["between"]:
            shp = [x for k in pos for x in shapes[k] if x]
            if any(sig(x) for x in shp):
                rows += pos
                causal = causal or any(sig.broadcast_square(x) for x in shp)
        mods = {module[c["scores"][0]], module[c["softmax"][0]], module[c["pv"][0]]}
        mod = _common_ancestor(sorted(mods))
        if c["sq"] == c["sk"] and not causal:
            # A causal mask built in the forward itself (torch.tril(torch.ones(T, T)) each call).
            causal = (c["step"], mod) in tril_at
        cls = next((str(dcls[k]) for k in c["scores"] if dims[k] and isinstance(dcls[k], str)), "fp32")
        out.append({"step": c["step"], "module": mod, "modules": sorted(mods), "b": c["b"], "sq": c["sq"],
                    "sk": c["sk"], "d": c["d"], "dv": c["dv"], "causal": causal, "dtype class": cls,
                    "rows": list(labels[sorted(rows)])})
    return out


def backward_rows(ops: pd.DataFrame, chains: list[dict]) -> pd.Index:
    """Backward rows of the chains' modules (same step) whose input, or matmul output, is a
    scores-sized tensor (b x Sq x Sk), with the rows nested in them."""
    if "phase" not in ops or not chains:
        return pd.Index([])
    bwd = ops[ops["phase"] == "bwd"]
    sigs: dict[tuple, list[_Sig]] = defaultdict(list)
    for c in chains:
        for m in c["modules"]:
            sigs[(c["step"], m)].append(_Sig(c["b"], c["sq"], c["sk"], strict=True))
    sel = []
    for (step, mod), ss in sigs.items():
        part = bwd[(bwd["step"] == step) & (bwd["module"] == mod)]
        for i, op, shp in zip(part.index, part["op"], part["input_shapes"]):
            shapes = arg_shapes(shp)
            d = mm_dims(op, shapes)
            outs = [(d[0], d[1], d[3])] if d else []
            if any(s(x) for s in ss for x in shapes + outs):
                sel.append(i)
    if not sel:
        return pd.Index([])
    # Nested rows (a composite's children) go with their parent.
    ids = pd.to_numeric(bwd["op_id"], errors="coerce").to_numpy()
    parents = pd.to_numeric(bwd["parent_id"], errors="coerce").to_numpy()
    mask = bwd.index.isin(sel)
    for _ in range(16):
        grown = mask | np.isin(parents, ids[mask])
        if (grown == mask).all():
            break
        mask = grown
    return bwd.index[mask]


def sdpa_us(c: dict, summary: dict) -> float:
    """SDPA's roofline time (fwd + bwd, us) for one chain; see the module docstring."""
    from kprof.analyze.modules import roofline_us
    from kprof.kernels.registry import Cost

    cls = c["dtype class"]
    if cls == "fp32" and summary.get("tf32_assumed"):
        cls = "tf32"
    f = 2.0 * c["b"] * c["sq"] * c["sk"] * (c["d"] + c["dv"]) * (0.5 if c["causal"] else 1.0)
    elt = _ITEMSIZE.get(cls, 4)
    t = (c["b"] * c["sq"] * c["d"] + c["b"] * c["sk"] * (c["d"] + c["dv"]) + c["b"] * c["sq"] * c["dv"]) * elt
    ceil = summary.get("ceilings") or {}
    return roofline_us(Cost(f, t), ceil, cls) + roofline_us(Cost(2.5 * f, 2 * t), ceil, cls)


def rule_covered(ops: pd.DataFrame, summary: dict) -> set[str]:
    """Module paths the built-in attention kernel rules already suggest SDPA for."""
    from kprof.analyze.modules import module_table
    from kprof.rules import RULES
    from kprof.rules.engine import match_pattern

    try:
        table = module_table(ops, summary.get("module_classes"))
    except (KeyError, ValueError):
        return set()
    return {p for r in RULES if r.id.startswith("attention") for p in match_pattern(r.profile, table)}


def _source(summary: dict, paths: list[str], ops: pd.DataFrame) -> str:
    """file:line of the first softmax call in the module's forward (classes defined in the
    profiled script, read with ast), or the run's recorded module source."""
    from kprof.analyze.modules import script_sources

    src = dict(script_sources(summary.get("script"), "softmax"))
    src.update(summary.get("module_sources") or {})
    classes = dict(summary.get("module_classes") or {})
    if "module_class" in ops:
        classes.update(ops.drop_duplicates("module").set_index("module")["module_class"].to_dict())
    for p in paths:
        s = src.get(p) or src.get(classes.get(p, ""))
        if s:
            return str(s)
    return ""


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    chains = find_chains(ops)
    if not chains:
        return []
    covered = rule_covered(ops, summary)
    chains = [c for c in chains if c["module"] not in covered and not set(c["modules"]) & covered]
    if not chains:
        return []
    n = n_steps(ops, summary)
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0)
    bwd = backward_rows(ops, chains)
    per_mod: dict[str, dict] = {}
    for c in chains:
        d = per_mod.setdefault(c["module"], {"fwd": [], "chains": [], "pred": 0.0})
        d["fwd"] += c["rows"]
        d["chains"].append(c)
        d["pred"] += sdpa_us(c, summary)
    details = []
    total = predicted = 0.0
    for mod, d in per_mod.items():
        b_rows = [i for i in bwd if ops.at[i, "module"] in {m for c in d["chains"] for m in c["modules"]}]
        rows = pd.Index(sorted(set(d["fwd"]) | set(b_rows)))
        ms = float(t.loc[rows].sum()) / n / 1e3
        pred = d["pred"] / n / 1e3
        c0 = d["chains"][0]
        total += ms
        predicted += pred
        details.append({"module": mod, "per step": len(d["chains"]) / n, "ms/step": ms, "sdpa ms/step": pred,
                        "batch x heads": c0["b"], "q len": c0["sq"], "k len": c0["sk"], "head dim": c0["d"],
                        "v dim": c0["dv"], "dtype class": c0["dtype class"], "causal": c0["causal"],
                        "rows": len(rows)})
    details.sort(key=lambda r: -r["ms/step"])
    ceil = summary.get("ceilings") or {}
    known = bool(ceil.get("peak_tflops")) and bool(ceil.get("mem_bw_gbs"))
    saving = max(total - predicted, 0.0) if known and math.isfinite(predicted) else math.nan
    st = step_ms(summary)
    gate = saving if math.isfinite(saving) else total
    if math.isfinite(st) and st > 0 and gate / st * 100 < MIN_SAVING_PCT:
        return []

    from kprof.analyze.modules import group_paths

    paths = [r["module"] for r in details]
    where = ", ".join(f"{g} x {k}" if k > 1 else g or "<model>" for g, k in group_paths(paths))
    c0 = details[0]
    causal = all(r["causal"] for r in details)
    mask_note = ("causal: a square mask broadcast over batch and heads, or tril/triu in the forward" if causal
                 else "costed as full, non-causal attention")
    per_step = sum(r["per step"] for r in details)
    evidence = (f"{per_step:g} hand-written attention(s)/step: matmul -> scale/mask -> softmax -> matmul on "
                f"[{c0['batch x heads']}, {c0['q len']}, {c0['k len']}] scores (batch x heads, q len, k len), head dim "
                f"{c0['head dim']}, {c0['dtype class']}; {total:.2f} ms/step fwd+bwd\n"
                f"SDPA estimate {predicted:.3f} ms/step; {mask_note}")
    is_causal = "is_causal=True" if causal else "attn_mask=mask"
    how = (f"replace the scores/mask/softmax/matmul lines with `y = F.scaled_dot_product_attention(q, k, v, {is_causal})` "
           "(q, k, v shaped (batch, heads, seq, head_dim); pass scale= if yours is not 1/sqrt(head_dim), "
           "dropout_p= for attention dropout)")
    note = ("measured fwd+bwd time of the matched ops - SDPA roofline (FLOPs 2*b*Sq*Sk*(D+Dv) fwd, x3.5 fwd+bwd, "
            "halved if causal, at this run's ceilings)") if math.isfinite(saving) else \
        "no matmul peak or bandwidth in this run's ceilings: run `kprof calibrate`"
    src = _source(summary, paths, ops)
    at = site(src)
    diff = edits.sdpa(at[0], at[1], causal) if at else no_diff(
        "the attention's source line is not known (the module is not defined in the profiled script)")
    return [Finding(
        where=where,
        evidence=evidence,
        change="torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient kernel: the scores never "
               "reach memory)",
        how=how,
        ms_per_step=total,
        saving_ms=saving,
        saving_note=note,
        source=src,
        paths=paths,
        cls="attention (hand-written)",
        # The chain is found from shapes in call order: sure. The saving is a roofline model,
        # meaningful at measured or datasheet ceilings, not at the labelled CPU default.
        confidence="medium" if ceil.get("kind") == "default" else "high",
        details=details,
        diff=diff,
    )]


DIAGNOSIS = Diagnosis(id="manual_attention", title="attention written out by hand", find=find)

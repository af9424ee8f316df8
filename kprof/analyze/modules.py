"""Module-level views of a run's op table, shared by the planner (kprof.plan) and the rules'
profile matchers and diagnoses (kprof.rules): pure functions over the run's DataFrames and
summary dict."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from kprof.analyze.tables import step_basis

MATMUL_OPS = ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm")

SKIP_MODULES = ("<unattributed>", "<optimizer>")

# A GPU step whose kernels fill less than half of it is host-bound: the host's launches, not the
# GPU's work, set its time. Measured on the H200 (2026-11-29), a tiny GPT (2 layers, hidden 128,
# batch 8x512, bf16): GPU busy 1.22 ms of a 5.27 ms eager step (23%; 9% of the profiled window).
# All its suggestions applied cut GPU busy to 0.82 ms/step, yet the step went to 11.8 ms: a
# Triton kernel called through an autograd.Function costs the host 163 us per forward+backward
# against 12 us for an aten op (benchmarks/results/host-overhead-h200-20261129.txt). The Llama-1B
# run on the same GPU, where the patches are worth applying, is 99% busy (98.5 ms of 99.4 ms,
# summary-20261129-190658-llama_train.json).
HOST_BOUND_BUSY_PCT = 50.0

def op_base(op: pd.Series) -> pd.Series:
    """'aten::_log_softmax' -> 'log_softmax': namespace and leading underscores dropped."""
    return op.astype(str).str.replace(r"^.*::", "", regex=True).str.lstrip("_")

def hits(names: pd.Series, wanted: Sequence[str]) -> pd.Series:
    """Names equal to one of `wanted` or extending it with '_' (softmax -> softmax_backward_data)."""
    if not wanted:
        return pd.Series(False, index=names.index)
    pat = "^(?:" + "|".join(re.escape(w) for w in wanted) + r")(?:_.*)?$"
    return names.str.match(pat)

def parent_path(path: str) -> str | None:
    if path == "":
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""

def module_table(ops: pd.DataFrame, module_classes: dict | None = None) -> pd.DataFrame:
    """One row per module path: its own forward op names (set) and its direct children.
    Paths come from the ops and from the run's `module_classes` (modules that run no op of
    their own, like a container MLP, are still parents), plus every ancestor."""
    fwd = ops[(ops["phase"] == "fwd") & ~ops["module"].isin(SKIP_MODULES)]
    names = op_base(fwd["op"])
    if "called_op" in fwd:
        # A GPU profile has rows only for ops that launch kernels: the op the code called (e.g.
        # scaled_dot_product_attention, whose math backend launches bmm/_softmax) is kept beside
        # them, so patterns see the same names as on a CPU profile, where every op is a row.
        names = pd.concat([names, op_base(fwd["called_op"].fillna(fwd["op"]))])
    own = (pd.DataFrame({"module": fwd["module"].reindex(names.index).to_numpy(), "_n": names.to_numpy()})
           .groupby("module", sort=False)["_n"].agg(lambda s: frozenset(s)))
    cls = dict(module_classes or {})
    cls.update(ops.drop_duplicates("module").set_index("module")["module_class"].to_dict())
    seen: dict[str, None] = {}
    for p in list(cls):
        if p in SKIP_MODULES:
            continue
        while p is not None and p not in seen:
            seen[p] = None
            p = parent_path(p)
    paths = list(seen)
    t = pd.DataFrame({"module": paths})
    t["own"] = [own.get(p, frozenset()) for p in paths]
    t["module_class"] = [cls.get(p, "") for p in paths]
    t["parent"] = [parent_path(p) for p in paths]
    kids: dict[str, list[str]] = {}
    for p, par in zip(t["module"], t["parent"]):
        if par is not None:
            kids.setdefault(par, []).append(p)
    t["children"] = [kids.get(p, []) for p in paths]
    return t.set_index("module", drop=False)

def with_descendants(ops: pd.DataFrame, sel: np.ndarray) -> np.ndarray:
    """Add ops nested under selected ops (a matmul's copy_ and bmm children belong to it)."""
    if "op_id" not in ops or "parent_id" not in ops:
        return sel
    ids = pd.to_numeric(ops["op_id"], errors="coerce").to_numpy()
    parents = pd.to_numeric(ops["parent_id"], errors="coerce").to_numpy()
    for _ in range(16):  # nesting depth of aten ops is < 10 in practice
        grown = sel | np.isin(parents, ids[sel])
        if (grown == sel).all():
            break
        sel = grown
    return sel

def group_paths(paths: Sequence[str]) -> list[tuple[str, int]]:
    """['model.layers.0.mlp', 'model.layers.1.mlp'] -> [('model.layers.*.mlp', 2)]."""
    pats: dict[str, int] = {}
    for p in paths:
        g = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", p)
        pats[g] = pats.get(g, 0) + 1
    return sorted(pats.items(), key=lambda kv: (-kv[1], kv[0]))

def roofline_us(cost, ceilings: dict, cls: str) -> float:
    """max(FLOPs / peak, bytes / bandwidth) in µs, at least one launch latency."""
    peaks = ceilings.get("peak_tflops") or {}
    fallback = {"tf32": ("tf32", "fp32"), "bf16": ("bf16", "fp16", "fp32"), "fp16": ("fp16", "bf16", "fp32")}
    peak = next((float(peaks[k]) for k in fallback.get(cls, (cls, "fp32")) if peaks.get(k)), math.nan)
    bw = float(ceilings.get("mem_bw_gbs") or math.nan)
    t = max(cost.flops / (peak * 1e12), cost.bytes / (bw * 1e9)) * 1e6
    return max(t, float(ceilings.get("latency_us") or 0.0))

def script_sources(script: str | None, hint: str | None = None) -> dict[str, str]:
    """{class name: "file:line"} for classes defined in the profiled script itself, read with
    `ast` (nothing is imported or run): the line of the first call named `hint` in the class's
    forward (e.g. "softmax", the line a code change starts at), else of `def forward`."""
    import ast

    if not script or not Path(script).is_file():
        return {}
    try:
        tree = ast.parse(Path(script).read_text(), filename=script)
    except (SyntaxError, OSError, UnicodeDecodeError):
        return {}
    out = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        fwd = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "forward"), None)
        if fwd is None:
            continue
        line = fwd.lineno
        if hint:
            calls = [c for c in ast.walk(fwd) if isinstance(c, ast.Call)
                     and getattr(c.func, "attr", getattr(c.func, "id", None)) == hint]
            if calls:
                line = min(c.lineno for c in calls)
        out[cls.name] = f"{script}:{line}"
    return out

def busy_share(summary: dict) -> dict | None:
    """The busy share of the step on tables.step_basis (the unprofiled step), for any run:
    {"busy %", "busy ms/step", "step ms", "idle ms/step", "basis"}; summary["busy_pct"] for a
    run without idle_by_step rows (older runs). None without the evidence."""
    rows = summary.get("idle_by_step") or []
    plain_ms = (summary.get("step_time_ms") or {}).get("median")
    b = step_basis(median_of(rows, "busy (us)"), median_of(rows, "window (us)"), plain_ms)
    if math.isfinite(b["busy %"]) and b["basis"] == "unprofiled step":
        return {"busy %": b["busy %"], "busy ms/step": b["busy (us)"] / 1e3, "step ms": b["step (us)"] / 1e3,
                "idle ms/step": b["idle (us)"] / 1e3, "basis": "unprofiled step time"}
    if summary.get("busy_pct") is None:  # no unprofiled steps: the profiled window
        if not math.isfinite(b["busy %"]):
            return None
        return {"busy %": b["busy %"], "busy ms/step": b["busy (us)"] / 1e3, "step ms": b["step (us)"] / 1e3,
                "idle ms/step": b["idle (us)"] / 1e3, "basis": "profiled steps"}
    window_us = median_of(rows, "window (us)")
    if not (math.isfinite(window_us) and window_us > 0):
        window_us = float((summary.get("profiled_step_time_ms") or {}).get("median") or math.nan) * 1e3
    pct = float(summary["busy_pct"])
    busy_us = b["busy (us)"] if math.isfinite(b["busy (us)"]) else pct / 100 * window_us
    return {"busy %": pct, "busy ms/step": busy_us / 1e3, "step ms": window_us / 1e3,
            "idle ms/step": max(window_us - busy_us, 0.0) / 1e3, "basis": "profiled steps"}


def gpu_busy(summary: dict) -> dict | None:
    """busy_share on a GPU run: the GPU's busy time against the unprofiled step. None on CPU
    runs and without the evidence."""
    if not is_gpu_run(summary):
        return None  # a CPU's "busy" is op time on the host: nothing idles while the host launches
    return busy_share(summary)


def step_ms(summary: dict) -> float:
    """The step every "% of step" and saving figure divides by: the unprofiled step's median
    (tables.step_basis), the profiled one for a run that timed no unprofiled steps."""
    b = busy_share(summary)
    if b is not None and math.isfinite(b["step ms"]):
        return float(b["step ms"])
    return float((summary.get("step_time_ms") or {}).get("median")
                 or (summary.get("profiled_step_time_ms") or {}).get("median") or math.nan)


def host_bound(summary: dict) -> dict | None:
    """gpu_busy(summary) with the caveat for kernel rows when the GPU is busy less than
    HOST_BOUND_BUSY_PCT of the step; None when it isn't host-bound (or can't be told)."""
    busy = gpu_busy(summary)
    if busy is None or busy["busy %"] >= HOST_BOUND_BUSY_PCT:
        return None
    ms = (f"{busy['busy ms/step']:.2f} of {busy['step ms']:.2f} ms, " if math.isfinite(busy["step ms"]) else "")
    caveat = (f"GPU busy only {busy['busy %']:.0f}% of the step ({ms}{busy['basis']}): the step is host-bound. "
              "GPU time saved will not shorten it, and each patched module adds host launch time. Fix the "
              'host side first (CUDA graphs, torch.compile(mode="reduce-overhead"), a larger batch): see the '
              "diagnoses.")
    return busy | {"threshold %": HOST_BOUND_BUSY_PCT, "caveat": caveat}


def is_gpu_run(summary: dict) -> bool:
    return (summary.get("device") or {}).get("type") == "cuda"


def median_of(rows: list[dict], key: str) -> float:
    """Median of rows[i][key] over the rows where it is a finite number (nan if none)."""
    xs = [float(r[key]) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]
    return statistics.median(xs) if xs else math.nan

"""`kprof suggest`: from a saved profile to a ranked plan of fixes. Pure functions over the run's
DataFrames; rendering lives in kprof/cli_patch.py.

No model is needed: each rule's `ProfilePattern` is matched against the op table (which ops ran
in each module, forward phase), the matched modules' evidence ops give the measured time, and the
replacement's roofline time at the same shapes gives the prediction:

    saving = measured time of the evidence ops (fwd + bwd, per step)
             - roofline time of the kernel at those shapes (KernelSpec.cost -> FLOPs and bytes,
               at the run's ceilings: max(FLOPs / peak, bytes / bandwidth), at least one launch
               latency per pass)

`kprof apply` then confirms each planned match on the live model (structure + probe) before it
patches anything, so a profile-side false positive costs a line in the report, never a wrong
result.

A host-bound step (the GPU busy less than HOST_BOUND_BUSY_PCT of it) keeps the GPU-time savings
but marks every row "low" with a caveat, and the plan carries `plan.attrs["host_bound"]`: there,
GPU time saved does not shorten the step, and each patched module adds host time.

The plan is saved as `plan.json` in the run directory.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from kprof.errors import KprofError

PLAN = "plan.json"
_MATMUL = ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm")
_SKIP_MODULES = ("<unattributed>", "<optimizer>")
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


def _hits(names: pd.Series, wanted: Sequence[str]) -> pd.Series:
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
    fwd = ops[(ops["phase"] == "fwd") & ~ops["module"].isin(_SKIP_MODULES)]
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
        if p in _SKIP_MODULES:
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


def match_pattern(pattern, table: pd.DataFrame) -> list[str]:
    """Module paths whose recorded ops fit a rule's ProfilePattern (see rules/engine.py)."""
    def has(names: frozenset, wanted) -> list[bool]:
        return [any(n == w or n.startswith(w + "_") for n in names) for w in wanted]

    out = []
    for path, own, children in zip(table["module"], table["own"], table["children"]):
        if pattern.root_only and path != "":
            continue
        if not all(has(own, pattern.own_all)):
            continue
        if pattern.own_any and not any(has(own, pattern.own_any)):
            continue
        if any(has(own, pattern.own_none)):
            continue
        kid_own = [table.at[c, "own"] for c in children]
        if pattern.child_any and not any(any(has(k, pattern.child_any)) for k in kid_own):
            continue
        n_mm = sum(any(has(k, _MATMUL)) for k in kid_own)
        if n_mm < pattern.child_linear or (pattern.child_linear_max is not None and n_mm > pattern.child_linear_max):
            continue
        out.append(path)
    return out


def _with_descendants(ops: pd.DataFrame, sel: np.ndarray) -> np.ndarray:
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


def evidence_ops(pattern, ops: pd.DataFrame, table: pd.DataFrame, path: str) -> pd.DataFrame:
    """The ops (all steps, fwd and bwd) a rule's replacement removes at one module path."""
    mod = ops["module"]
    in_subtree = (mod == path) | mod.str.startswith(path + ".") if path else ~mod.isin(_SKIP_MODULES)
    sub = ops[in_subtree & ops["phase"].isin(["fwd", "bwd"])]
    names = op_base(sub["op"])
    sel = np.zeros(len(sub), dtype=bool)
    for item in pattern.evidence:
        kind, _, name = item.partition(":") if ":" in item else ("*", "", "")
        if kind == "*":
            sel[:] = True
        elif kind == "own":
            sel |= ((sub["module"] == path) & _hits(names, [name])).to_numpy()
        elif kind == "subtree":
            sel |= _hits(names, [name]).to_numpy()
        elif kind == "childmod":
            kids = [c for c in table.at[path, "children"]
                    if any(n == name or n.startswith(name + "_") for n in table.at[c, "own"])]
            sel |= sub["module"].isin(kids).to_numpy()
    return sub[_with_descendants(sub, sel)]


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


def _dtype_class(dtype, tf32: bool) -> str:
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "tf32" if tf32 else "fp32")


def predict_us(rule, problem: dict | None, summary: dict) -> float | None:
    """Roofline time of the replacement (fwd + bwd) for one matched module, or None if unknown."""
    from kprof.rules.engine import kernel_spec

    if problem is None:
        return None
    cost_fn = rule.cost
    if cost_fn is None:
        spec = kernel_spec(rule.kernels[0]) if rule.kernels else None
        if spec is None:
            return None
        cost_fn = spec.cost
    try:
        costs = cost_fn(**problem)
    except TypeError:
        return None  # the kernel's problem keys changed: say "unknown", don't guess
    cls = _dtype_class(problem.get("dtype"), bool(summary.get("tf32_assumed"))) if rule.tensor_core else "fp32"
    return sum(roofline_us(c, summary.get("ceilings") or {}, cls) for c in costs.values())


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


def _source(summary: dict, paths: Sequence[str], classes: Sequence[str], hint: str | None = None) -> str:
    """file:line of the matched module's code: from the run (summary['module_sources'], keyed by
    module path or class name) if the profiler recorded it, else for classes defined in the
    script, from the script's source."""
    src = dict(script_sources(summary.get("script"), hint))
    src.update(summary.get("module_sources") or {})
    for p, c in zip(paths, classes):
        s = src.get(p) or src.get(c)
        if s:
            return str(s)
    return ""


def gpu_busy(summary: dict) -> dict | None:
    """The GPU's busy share of the step on a GPU run: median busy time over the recorded steps
    against the unprofiled step time (or the profiled window, if shorter); summary["busy_pct"]
    when the runner timed no unprofiled steps. None on CPU runs and without the evidence."""
    from kprof.rules.diagnoses.base import is_gpu_run
    from kprof.rules.diagnoses.launch_bound import _median

    if not is_gpu_run(summary):
        return None  # a CPU's "busy" is op time on the host: nothing idles while the host launches
    rows = summary.get("idle_by_step") or []
    busy_us, window_us = _median(rows, "busy (us)"), _median(rows, "window (us)")
    plain_ms = float((summary.get("step_time_ms") or {}).get("median") or math.nan)
    # The profiler adds host time to every op, so the profiled window understates the busy share
    # (9% against 23% unprofiled on the tiny GPT above); the kernels take the same time either way.
    if math.isfinite(busy_us) and math.isfinite(plain_ms) and plain_ms > 0:
        step_us = min(window_us, plain_ms * 1e3) if math.isfinite(window_us) and window_us > 0 else plain_ms * 1e3
        return {"busy %": min(busy_us / step_us * 100, 100.0), "busy ms/step": busy_us / 1e3,
                "step ms": step_us / 1e3, "basis": "unprofiled step time"}
    if not (math.isfinite(window_us) and window_us > 0):
        window_us = float((summary.get("profiled_step_time_ms") or {}).get("median") or math.nan) * 1e3
    pct = (float(summary["busy_pct"]) if summary.get("busy_pct") is not None
           else busy_us / window_us * 100 if window_us > 0 else math.nan)
    if not math.isfinite(pct):
        return None
    if not math.isfinite(busy_us):
        busy_us = pct / 100 * window_us
    return {"busy %": pct, "busy ms/step": busy_us / 1e3, "step ms": window_us / 1e3, "basis": "profiled steps"}


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


def suggest(run, rules: Sequence[Any] | None = None) -> pd.DataFrame:
    """Ranked suggestions for a saved run (kprof.store.Run). One row per rule that matched.
    plan.attrs["host_bound"]: host_bound(run.summary) (None when the step isn't host-bound)."""
    from kprof.rules import RULES

    rules = list(RULES if rules is None else rules)
    ops, summary = run.ops, run.summary
    if ops is None or not len(ops):
        raise KprofError(f"run {run.name} has no ops; profile again (kprof profile SCRIPT)")
    n_steps = max(int(summary.get("steps_recorded") or ops["step"].nunique() or 1), 1)
    step_ms = ((summary.get("profiled_step_time_ms") or {}).get("median")
               or (summary.get("step_time_ms") or {}).get("median") or math.nan)
    table = module_table(ops, summary.get("module_classes"))
    hb = host_bound(summary)
    rows = []
    # Patterns are exclusive by construction (an RMSNorm has no layer_norm op, a gated MLP has the
    # multiply a Linear -> GELU lacks) and evidence selectors don't overlap (attention's matmuls
    # and softmax vs RoPE's mul/neg/cat in the same module), so no op is counted twice.
    for rule in rules:
        paths = match_pattern(rule.profile, table)
        if not paths:
            continue
        measured = predicted = 0.0
        known = True
        evs = []
        for p in paths:
            ev = evidence_ops(rule.profile, ops, table, p)
            evs.append(ev)
            measured += float(pd.to_numeric(ev["device_time (us)"], errors="coerce").fillna(0).sum()) / n_steps
            fwd_ev = ev[ev["step"] == ev["step"].min()] if len(ev) else ev
            pr = predict_us(rule, rule.problem(fwd_ev) if rule.problem else None, summary)
            if pr is None:
                known = False
            else:
                predicted += pr
        ev = pd.concat(evs) if evs else ops.iloc[:0]
        t = pd.to_numeric(ev["device_time (us)"], errors="coerce").fillna(0)
        att = pd.to_numeric(ev.get("attainable (us)"), errors="coerce") if "attainable (us)" in ev else None
        cls = (ev.assign(_t=t).groupby("class")["_t"].sum().idxmax() if len(ev) and "class" in ev else "")
        pct_roof = float(att.fillna(0).sum() / t.sum() * 100) if att is not None and t.sum() > 0 else math.nan
        saving = max(measured - predicted, 0.0) if known else math.nan
        classes = [table.at[p, "module_class"] for p in paths]
        rows.append({
            "id": rule.id,
            "title": rule.title,
            "where": ", ".join(f"{g} x {n}" if n > 1 else g or "<model>" for g, n in group_paths(paths)),
            "paths": paths,
            "module_class": ", ".join(sorted(set(classes))),
            "source": _source(summary, paths, classes, "softmax" if rule.id.startswith("attention") else None),
            "ms/step": measured / 1e3,
            "% of step": measured / 1e3 / step_ms * 100 if step_ms == step_ms and step_ms else math.nan,
            "class": cls,
            "% of roofline": pct_roof,
            "change": rule.change,
            "predicted ms/step": predicted / 1e3 if known else math.nan,
            "saving ms/step": saving / 1e3 if known else math.nan,
            "saving %": saving / 1e3 / step_ms * 100 if known and step_ms == step_ms and step_ms else math.nan,
            # Host-bound: the GPU-time saving stands, but the step won't get shorter by it.
            "confidence": rule.confidence if known and hb is None else "low",
            "caveat": hb["caveat"] if hb else "",
            "applyable": rule.applyable,
            "how": "kprof apply --patch " + rule.id if rule.applyable else (
                rule.code_change or f"needs kernel(s) {', '.join(rule.missing_kernels())}"),
        })
    cols = ["id", "title", "where", "paths", "module_class", "source", "ms/step", "% of step", "class",
            "% of roofline", "change", "predicted ms/step", "saving ms/step", "saving %", "confidence",
            "caveat", "applyable", "how"]
    plan = pd.DataFrame(rows, columns=cols)
    if len(plan):
        # Known savings first, largest first; then unknown savings by measured time.
        plan = plan.assign(_k=plan["saving ms/step"].isna()).sort_values(
            ["_k", "saving ms/step", "ms/step"], ascending=[True, False, False]).drop(columns="_k")
    plan = plan.reset_index(drop=True)
    plan.attrs["host_bound"] = hb
    return plan


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating,)):
        return _clean(float(v))
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    return v


def plan_records(plan: pd.DataFrame) -> list[dict]:
    return [{k: _clean(v) for k, v in r.items()} for r in plan.to_dict("records")]


def save_plan(run, plan: pd.DataFrame, diagnoses: pd.DataFrame | None = None) -> Path:
    """plan.json: the kernel suggestions (what `kprof apply` patches) and, apart, the diagnoses
    (kprof.rules.diagnoses: changes the user makes in the script). "host_bound": the plan's
    attrs["host_bound"] (null when the step isn't host-bound)."""
    doc = {"run": run.name, "script": run.summary.get("script"), "argv": run.summary.get("argv"),
           "host_bound": _clean(plan.attrs.get("host_bound")), "suggestions": plan_records(plan)}
    if diagnoses is not None:
        doc["diagnoses"] = plan_records(diagnoses)
    path = Path(run.path) / PLAN
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def load_plan(run) -> dict:
    path = Path(run.path) / PLAN
    if not path.exists():
        raise KprofError(f"run {run.name} has no plan yet; run `kprof suggest {run.name}` first")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise KprofError(f"{path} is unreadable ({e}); run `kprof suggest {run.name}` again") from e

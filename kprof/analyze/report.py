"""The data of `kprof report --html`: one JSON-able dict built from what a run has (summary,
ops table, plan), with the parts it lacks named in `missing`. Pure: the CLI loads the files
(and catches a corrupt one) and renders the HTML (kprof/cli/html.py); nothing here reads or
writes a file, so a test can build the report of any partial run from plain objects.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import pandas as pd

from kprof.analyze.tables import top_ops

# The roofline's groups: one point per (module, op), all shapes and dtypes of it together, so a
# point is something the user can find in the model ("model.layers.0.mlp  aten::mm").
POINT_KEYS = ["module", "op"]


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _main_shapes(ops: pd.DataFrame) -> dict[tuple, str]:
    """Each (module, op) group's shapes with the most time, for the tooltip (a group can hold
    several shapes; the heaviest is the one worth knowing)."""
    if "shapes" not in ops or ops.empty:
        return {}
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0)
    d = ops.assign(_t=t, shapes=ops["shapes"].astype(str))
    heavy = (d.groupby(POINT_KEYS + ["shapes"], sort=False, dropna=False)["_t"].sum().reset_index()
             .sort_values("_t", ascending=False, kind="stable").drop_duplicates(POINT_KEYS))
    return {(r["module"], r["op"]): r["shapes"] for r in heavy.to_dict("records")}


def roofline_points(ops: pd.DataFrame, n_steps: int, step_ms: float | None) -> list[dict]:
    """One record per (module, op) group of the op table, heaviest first. `placed` says whether
    it can sit on a log-log roofline: it needs a known, positive intensity and FLOP rate (a copy
    does no FLOPs, an op without a cost formula has neither); `why_not` says why not."""
    if ops is None or ops.empty:
        return []
    g = top_ops(ops, n_steps, k=None, keys=POINT_KEYS)
    shapes = _main_shapes(ops)
    points = []
    for r in g.to_dict("records"):
        ms = _num(r["time/step (ms)"]) or 0.0
        x, y = _num(r["intensity (FLOP/B)"]), _num(r["TFLOP/s"])
        if x is None or y is None:
            why = "no FLOP/byte cost formula" if r["class"] == "unknown" else "no FLOPs or bytes known"
        elif x <= 0 or y <= 0:
            why = "no FLOPs (a copy, a view or an indexing op)"
        else:
            why = None
        points.append({
            "module": str(r["module"]), "op": str(r["op"]), "shapes": shapes.get((r["module"], r["op"]), ""),
            "ms_per_step": ms, "pct_step": 100.0 * ms / step_ms if step_ms else None,
            "calls_per_step": _num(r["calls/step"]), "intensity": x, "tflops": y, "gbs": _num(r["GB/s"]),
            "pct_roofline": _num(r["% of roofline"]), "class": str(r["class"]),
            "placed": why is None, "why_not": why,
        })
    return points


def _ceilings(c: dict) -> dict:
    """The ceilings the roofline draws: the memory slope (GB/s) and one flat line per dtype peak."""
    peaks = {k: v for k in ("fp32", "tf32", "bf16", "fp16", "fp8")
             if (v := _num((c.get("peak_tflops") or {}).get(k))) and v > 0}
    bw = _num(c.get("mem_bw_gbs"))
    return {"mem_bw_gbs": bw if bw and bw > 0 else None, "peak_tflops": peaks, "latency_us": _num(c.get("latency_us")),
            "kind": c.get("kind"), "source": c.get("source"), "notes": list(c.get("notes") or [])}


def report_data(summary: dict, ops: pd.DataFrame | None, plan: dict | None, *, run_name: str,
                missing: Sequence[str] = (), trace_path: str | None = None) -> dict:
    """Everything the HTML report shows. `ops` None: the op table could not be read (the roofline
    is then empty and `missing` says why); `plan` None: no suggestions. The summary's own tables
    (classes, top ops, syncs) need no op table, so they are shown whatever else is missing."""
    dev = summary.get("device") or {}
    st = summary.get("step_time_ms") or {}
    step_ms = _num(st.get("median"))
    n_steps = int(summary.get("steps_recorded") or 0)
    if ops is not None and not n_steps and "step" in ops:
        n_steps = int(ops["step"].nunique())
    points = roofline_points(ops, n_steps, step_ms) if ops is not None else []
    suggestions = []
    if plan:
        both = [*(plan.get("suggestions") or []), *(plan.get("diagnoses") or [])]
        suggestions = sorted(both, key=lambda r: (_num(r.get("rank")) is None, _num(r.get("rank")) or 0))
    return {
        "run": run_name,
        "trace_path": trace_path,
        "header": {
            "script": " ".join([str(summary.get("script", "?")), *map(str, summary.get("argv") or [])]),
            "status": summary.get("status"), "status_note": summary.get("status_note"),
            "device": dev.get("name"), "device_type": dev.get("type"),
            "step_definition": summary.get("step_definition"),
            "step_ms": step_ms, "step_spread_ms": _num(st.get("spread")),
            "tokens_per_s": _num(summary.get("tokens_per_s")), "busy_pct": _num(summary.get("busy_pct")),
            "coverage_pct": _num(summary.get("coverage_pct")), "kprof_version": summary.get("kprof_version"),
            "warnings": list(summary.get("warnings") or []),
        },
        "cpu": dev.get("type") == "cpu",
        "ceilings": _ceilings(summary.get("ceilings") or {}),
        "points": points,
        "classes": list(summary.get("class_breakdown") or []),
        "top_ops": list(summary.get("top_ops") or []),
        "syncs": list(summary.get("syncs") or []),
        "suggestions": suggestions,
        "missing": list(missing),
    }

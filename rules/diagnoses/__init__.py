"""Diagnoses: what slows a training step that no fused kernel fixes (shipped as `kprof.rules.diagnoses`).

A kernel rule (kprof.rules) matches a pattern in the model and swaps in a kernel. A diagnosis
reads the same saved run (summary.json and ops.parquet, no model, no re-run) and points at a
one-line change in the user's script: a host sync in the loop, fp32 matmuls on tensor cores, an
unfused optimizer. Each diagnosis is one module beside this file holding its data (what to
look for, the fix for each case) and one pure function `find(ops, summary) -> list[Finding]`.

`DIAGNOSES` is the built-in list, in the order `kprof suggest` reports them (after the kernel
rules, in the same table; `--json` and plan.json carry them under "diagnoses", so `kprof apply`,
which only patches kernels, never sees them).
"""

from __future__ import annotations

import math

import pandas as pd

from kprof.rules.edits import no_diff
from kprof.rules.diagnoses import (
    fp32_matmul,
    graph_break,
    host_sync,
    input_pipeline,
    launch_bound,
    manual_attention,
    matmul_shapes,
    memory,
    strided_elementwise,
    moe,
    recompile,
    unfused_optimizer,
)
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, step_ms

DIAGNOSES: list[Diagnosis] = [
    host_sync.DIAGNOSIS,
    fp32_matmul.DIAGNOSIS,
    unfused_optimizer.DIAGNOSIS,
    input_pipeline.DIAGNOSIS,
    *launch_bound.DIAGNOSES,
    manual_attention.DIAGNOSIS,
    matmul_shapes.DIAGNOSIS,
    *memory.DIAGNOSES,
    strided_elementwise.DIAGNOSIS,
    *moe.DIAGNOSES,
    graph_break.DIAGNOSIS,
    recompile.DIAGNOSIS,
]

COLUMNS = ["id", "title", "where", "paths", "module_class", "source", "ms/step", "% of step", "class",
           "% of roofline", "change", "predicted ms/step", "saving ms/step", "saving %", "confidence",
           "applyable", "how", "evidence", "saving note", "details", "diff"]


def diagnose(run, diagnoses: list[Diagnosis] | None = None) -> pd.DataFrame:
    """All findings for a saved run (kprof.store.Run), one row each, in the plan's columns plus
    `evidence`, `saving note` and `details`. Order: diagnosis order, then the finder's order."""
    ops = run.ops if run.ops is not None else pd.DataFrame()
    summary = run.summary or {}
    st = step_ms(summary)

    def pct(v: float) -> float:
        return v / st * 100 if math.isfinite(v) and math.isfinite(st) and st > 0 else math.nan

    rows = []
    for d in DIAGNOSES if diagnoses is None else diagnoses:
        for f in d.find(ops, summary):
            rows.append({
                "id": d.id, "title": d.title, "where": f.where, "paths": list(f.paths), "module_class": "",
                "source": f.source, "ms/step": f.ms_per_step, "% of step": pct(f.ms_per_step), "class": f.cls,
                "% of roofline": math.nan, "change": f.change, "predicted ms/step": math.nan,
                "saving ms/step": f.saving_ms, "saving %": pct(f.saving_ms), "confidence": f.confidence,
                "applyable": f.applyable, "how": f.how, "evidence": f.evidence, "saving note": f.saving_note,
                "details": list(f.details),
                "diff": f.diff or no_diff(f"the {d.id} diagnosis derives no source change"),
            })
    return pd.DataFrame(rows, columns=COLUMNS)


__all__ = ["COLUMNS", "DIAGNOSES", "Diagnosis", "Finding", "diagnose", "is_gpu_run", "n_steps", "step_ms"]

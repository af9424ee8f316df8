"""Recompile under torch.compile: a guard of a compiled graph failed and Dynamo compiled again.

Dynamo guards every compiled graph on what it assumed: input shapes, Python scalars it read as
constants, module attributes. A new value recompiles (seconds to minutes for a large model, on
the step that meets it) and, after `torch._dynamo.config.recompile_limit` (8) versions, the
frame falls back to eager for good.

Evidence: summary["compile"]["recompiles"] (kprof/analyze/compiled.py, from Dynamo's
`recompiles` log artifact): the function recompiled, its first failed guard and, where Dynamo
gives it, the line of the script the guard came from. One finding per function and guard.

Change: a size that varies -> `torch._dynamo.mark_dynamic` or `dynamic=True`, or pad to a few
fixed sizes; a Python scalar that varies -> pass it as a tensor.

Saving: not estimated (compile time is outside the recorded steps).
"""

from __future__ import annotations

import math

import pandas as pd

from kprof.rules.diagnoses.base import Diagnosis, Finding


def _fix(guard: str) -> str:
    if "size mismatch" in guard or "stride mismatch" in guard:
        return "torch._dynamo.mark_dynamic(tensor, dim) or torch.compile(..., dynamic=True), or pad to fixed sizes"
    if "==" in guard:
        return "pass the varying Python value as a tensor, so Dynamo does not bake it in"
    return "keep what the guard checks constant across steps"


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    comp = summary.get("compile") or {}
    out = []
    for r in comp.get("recompiles") or []:
        line = r.get("guard_line") or r["line"]
        short = r["file"].rsplit("/", 1)[-1]
        out.append(Finding(
            where=f"{short}:{line} ({r['function']})",
            evidence=f"{r['function']} recompiled {r.get('count', 1)}x; failed guard: {r['guard']}",
            change="keep the guarded value constant, or make it dynamic",
            how=_fix(r["guard"]),
            saving_note="not estimated: compile time is outside the recorded steps",
            saving_ms=math.nan, source=f"{r['file']}:{line}", cls="recompile", confidence="high",
            details=[dict(r)],
        ))
    return out


DIAGNOSIS = Diagnosis(id="recompile", title="torch.compile recompile", find=find)

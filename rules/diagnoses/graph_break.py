"""Graph break under torch.compile: Dynamo split the compiled function at a line of the script.

Each break ends one compiled graph and starts another: the code between runs eagerly, Inductor
cannot fuse across the split, and the host returns to Python at every step. The usual causes
are a host sync (`.item()`, `.tolist()`, printing a tensor), an unsupported builtin or library
call (`print`, logging), or data-dependent control flow.

Evidence: summary["compile"]["graph_breaks"] (kprof/analyze/compiled.py, from Dynamo's
`graph_breaks` log artifact, recorded by the runner): the file, line, Dynamo's reason and hints,
and how many compiles logged it. One finding per line of user code.

Saving: not estimated. What the break costs (the eager code between the graphs, the lost
fusions, the extra launches) is not separable in the profile.
"""

from __future__ import annotations

import math

import pandas as pd

from kprof.rules.diagnoses.base import Diagnosis, Finding


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    comp = summary.get("compile") or {}
    out = []
    for b in comp.get("graph_breaks") or []:
        where = f"{_short(b['file'])}:{b['line']}"
        hint = (b.get("hints") or [""])[0]
        out.append(Finding(
            where=where,
            evidence=f"Dynamo broke the graph {b.get('count', 1)}x here: {b['reason']}",
            change="keep this line out of the compiled region, or make it traceable",
            how=hint or "move it out of forward, or torch._dynamo.config settings Dynamo names",
            saving_note="not estimated: the cost of a break is not separable in the profile",
            saving_ms=math.nan, source=f"{b['file']}:{b['line']}", cls="graph break", confidence="high",
            details=[dict(b)],
        ))
    return out


DIAGNOSIS = Diagnosis(id="graph_break", title="torch.compile graph break", find=find)

"""Strided elementwise and copy kernels that do not stream -> make the input contiguous, or fuse.

An elementwise op (add, mul, copy, cat, a RoPE rotate-half) moves its bytes once, so it is
memory-bound by intensity and should run near the copy bandwidth. Reading a non-contiguous view
(a slice of the last dimension, a transpose) it cannot use 128-bit vector loads and gathers
with a stride: on the H200, issue 26 found six such kernels (26% of a ~150M Llama's GPU time)
drawing 9.5-45% of DRAM bandwidth at 27-52% of roofline. kprof marks them `under-used` with the
cause `strided` (kprof/analyze/efficiency.py).

Evidence: ops.parquet rows of a GPU run that are memory-bound, `under-used`, with `strided`
among their causes, and not matmul-class (a strided matmul operand is cuBLAS's transpose flag,
free). Grouped by op and module pattern; a group under MIN_SHARE_PCT of the step is not
reported.

Saving: an upper bound, the group's measured time minus its roofline time (what the same bytes
take at the run's bandwidth): what fusing the op into its producer or consumer (torch.compile, a
kprof kernel) could win. A `.contiguous()` alone adds a copy of the input, so it wins less.
Confidence is `medium` at best: the under-used threshold is not fitted yet (efficiency.py).
"""

from __future__ import annotations

import math

import pandas as pd

from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, step_ms

# Same threshold as fp32_matmul.py: under 1% of the step is within a step's run-to-run spread
# (~1-3% on the H200 runs in benchmarks/results).
MIN_SHARE_PCT = 1.0
TOP_GROUPS = 3

HOW = ("where the view is made (x[..., :d], x.transpose(...), torch.cat of slices), call .contiguous() "
       "once if it is read several times; better, fuse the op with its neighbours: torch.compile, or a "
       "kprof kernel (`kprof suggest` lists the ones that match, e.g. rope)")


def strided_rows(ops: pd.DataFrame) -> pd.DataFrame:
    """Rows the diagnosis is about (see the module docstring)."""
    need = {"under-used", "causes", "class", "device_time (us)"}
    if ops is None or not len(ops) or not need <= set(ops.columns):
        return pd.DataFrame(columns=list(ops.columns) if ops is not None else [])
    sel = (ops["under-used"].fillna(False).astype(bool) & (ops["class"] == "memory-bound")
           & ops["causes"].astype(str).str.split(", ").map(lambda cs: "strided" in cs))
    if "tensor_core" in ops:
        sel &= ~ops["tensor_core"].fillna(False).astype(bool)
    return ops[sel]


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    if not is_gpu_run(summary):
        return []
    rows = strided_rows(ops)
    if not len(rows):
        return []
    from kprof.analyze.modules import group_paths

    n = n_steps(ops, summary)
    st = step_ms(summary)
    d = rows.assign(_t=pd.to_numeric(rows["device_time (us)"], errors="coerce").fillna(0.0),
                    _a=pd.to_numeric(rows.get("attainable (us)"), errors="coerce").fillna(0.0))
    out = []
    for op, g in sorted(d.groupby("op"), key=lambda kv: -kv[1]["_t"].sum()):
        ms = g["_t"].sum() / n / 1e3
        if math.isfinite(st) and st > 0 and ms / st * 100 < MIN_SHARE_PCT:
            continue
        saving = max(g["_t"].sum() - g["_a"].sum(), 0.0) / n / 1e3
        by_mod = g.groupby("module")["_t"].sum().sort_values(ascending=False)
        groups = group_paths(list(by_mod.index))
        where = ", ".join(f"{p} x {k}" if k > 1 else p or "<model>" for p, k in groups[:TOP_GROUPS])
        if len(groups) > TOP_GROUPS:
            where += f", +{len(groups) - TOP_GROUPS} more"
        ex = g.sort_values("_t", ascending=False).iloc[0]
        roof = 100.0 * g["_a"].sum() / g["_t"].sum() if g["_t"].sum() > 0 else math.nan
        short = str(op).removeprefix("aten::")
        out.append(Finding(
            where=f"{short} in {where}",
            evidence=(f"{len(g) / n:g} calls/step, {ms:.2f} ms/step at {roof:.0f}% of roofline on a non-contiguous "
                      f"input (e.g. shapes {ex.get('shapes', '?')}, strides {ex.get('input_strides', '?')}); "
                      f"causes: {ex.get('causes', '')}"),
            change="read contiguous memory: make the input contiguous once, or fuse the op with its neighbours",
            how=HOW,
            ms_per_step=ms,
            saving_ms=saving,
            saving_note="upper bound: measured time - roofline time of the same bytes (a fused op); "
                        "a .contiguous() adds a copy and wins less",
            paths=list(by_mod.index),
            cls="memory-bound, under-used",
            confidence="medium",
            details=[{"module": m, "ms/step": v / n / 1e3} for m, v in by_mod.items()],
        ))
    return out


DIAGNOSIS = Diagnosis(id="strided_elementwise", title="strided elementwise kernels under-using memory bandwidth",
                      find=find)

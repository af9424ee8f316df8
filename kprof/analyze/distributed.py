"""Communication and ranks: pure functions over one rank's busy intervals and the ranks' summaries.

One rank (`communication`): the collectives in `trace.kernel_table` (NCCL kernels on a GPU;
c10d / gloo ops on a CPU), their time per step, and how much of it is exposed: not overlapped by
other work on another stream (GPU) or thread (CPU). Exposed time is what the step waits for;
overlapped time is hidden behind compute.

Several ranks (`merge_ranks`): step time per rank and its skew, the slowest rank (the one the
before/after of `apply` is judged on), and the straggler: the rank the others wait for. In a
collective every rank waits for the last to arrive, so the straggler is the rank that spends
the least time in collectives while the others spend more.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import pandas as pd

# NCCL kernels (ncclDevKernel_AllReduce_Sum_bf16_RING_LL, ncclKernel_...), c10d ops as the
# profiler names them (c10d::allreduce_, c10d::_allgather_base_), functional collectives
# (_c10d_functional::all_reduce) and gloo's own ranges. Not aten::broadcast_tensors, which is
# shape arithmetic.
COMM_RE = re.compile(r"nccl|^c10d::|^_c10d_functional::|^gloo:|^record_param_comms$", re.IGNORECASE)


def is_comm(names: pd.Series) -> pd.Series:
    return names.astype(str).str.contains(COMM_RE)


def _union(iv: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed_us(comm: Sequence[tuple[float, float]], other: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(exposed, overlapped) time of the `comm` intervals against the `other` busy intervals."""
    c = _union(comm)
    total = sum(e - s for s, e in c)
    hidden = _overlap(c, _union(other))
    return total - hidden, hidden


def communication(kernels: pd.DataFrame, n_steps: int) -> dict | None:
    """Per step: collectives, their time, exposed and overlapped (all in ms/step, medians over
    the recorded steps). `kernels` is trace.kernel_table's frame. None without collectives."""
    if kernels is None or kernels.empty or n_steps <= 0:
        return None
    comm_mask = is_comm(kernels["name"])
    if not comm_mask.any():
        return None
    rows = []
    for step, k in kernels.groupby("step"):
        m = is_comm(k["name"])
        c = k[m]
        # Work on the same stream (or host thread) as a collective cannot run beside it.
        comm_streams = set(c["stream"])
        o = k[~m & ~k["stream"].isin(comm_streams)]
        exp, hid = exposed_us(list(zip(c["ts (us)"], c["end (us)"])), list(zip(o["ts (us)"], o["end (us)"])))
        rows.append({"step": step, "collectives": int(m.sum()), "comm (us)": exp + hid,
                     "exposed (us)": exp, "overlapped (us)": hid})
    df = pd.DataFrame(rows)
    med = df.median(numeric_only=True)
    names = kernels.loc[comm_mask, "name"].astype(str)
    return {
        "collectives per step": float(med["collectives"]),
        "comm ms/step": float(med["comm (us)"]) / 1e3,
        "exposed ms/step": float(med["exposed (us)"]) / 1e3,
        "overlapped ms/step": float(med["overlapped (us)"]) / 1e3,
        "kinds": sorted(set(names.map(_kind))),
        "by_step": df.to_dict("records"),
    }


def _kind(name: str) -> str:
    n = name.lower().replace("_", "")
    for kind in ("allreduce", "reducescatter", "allgather", "broadcast", "alltoall", "reduce", "send", "recv",
                 "barrier"):
        if kind in n:
            return {"allreduce": "all-reduce", "reducescatter": "reduce-scatter", "allgather": "all-gather",
                    "alltoall": "all-to-all"}.get(kind, kind)
    return "other"


def _median(summary: dict, key: str) -> float:
    v = (summary.get(key) or {}).get("median")
    return float(v) if v is not None else math.nan


def merge_ranks(summaries: Sequence[dict], world_size: int) -> dict:
    """The merged view of the ranks' summaries (each with its "rank"): a row per rank, the skew,
    the slowest rank and the straggler, and the ranks that saved nothing."""
    rows = []
    for s in sorted(summaries, key=lambda s: s.get("rank", 0)):
        comm = s.get("communication") or {}
        loader = [r.get("loader (us)") for r in (s.get("input_wait_by_step") or []) if r.get("loader (us)") is not None]
        rows.append({
            "rank": int(s.get("rank", 0)),
            "status": s.get("status"),
            "step ms": _median(s, "step_time_ms"),
            "profiled step ms": _median(s, "profiled_step_time_ms"),
            "comm ms/step": comm.get("comm ms/step", 0.0),
            "exposed comm ms/step": comm.get("exposed ms/step", 0.0),
            "loader ms/step": float(pd.Series(loader).median()) / 1e3 if loader else 0.0,
            "busy %": s.get("busy_pct"),
        })
    table = pd.DataFrame(rows)
    present = set(table["rank"]) if len(table) else set()
    out: dict = {"world_size": int(world_size), "ranks": _records(table),
                 "missing_ranks": sorted(set(range(world_size)) - present)}
    steps = table["step ms"].dropna() if len(table) else pd.Series(dtype=float)
    if len(steps) >= 2:
        med = float(steps.median())
        out["skew %"] = 100.0 * (float(steps.max()) - float(steps.min())) / med if med > 0 else math.nan
        out["slowest rank"] = int(table.loc[table["step ms"].idxmax(), "rank"])
        comm = table["comm ms/step"]
        # Everyone waits in the collective for the last rank to arrive: the straggler spends the
        # least time there. Named only when the others wait measurably longer (> 10% of a step).
        lo = int(table.loc[comm.idxmin(), "rank"])
        others = comm[table["rank"] != lo]
        wait = float(others.median()) - float(comm.min()) if len(others) else 0.0
        out["straggler"] = ({"rank": lo, "others wait ms/step": wait}
                            if wait > 0.1 * med else None)
    elif len(steps) == 1:
        out["slowest rank"] = int(table.loc[table["step ms"].idxmax(), "rank"])
    return out


def _records(df: pd.DataFrame) -> list[dict]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
            for r in df.to_dict("records")]

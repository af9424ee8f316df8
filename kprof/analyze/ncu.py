"""Nsight Compute's counters beside kprof's class (`kprof profile --ncu`): which kernels to measure,
ncu's CSV parsed, the reference class from the counters, and where the two disagree.

The reference rule (issue 26, fixed before measuring). ncu's SM throughput counts the load/store
units too, so a strided copy reads as "compute" there; the compute side is pipe utilization:
- memory-bound: DRAM throughput >= 50% of peak and above the compute pipe;
- compute-bound: the compute pipe >= 50% and above DRAM. The compute pipe is the tensor pipe
  (HMMA, and on sm_90 GMMA: the larger) for a tensor kernel, one whose tensor pipe was active
  for at least TENSOR_ACTIVE_PCT of its cycles, else the larger of the FMA and ALU pipes;
- neither: no bound reached. kprof's `latency-bound` and its `under-used` qualifier are the
  classes that mean this.
Communication and unknown-cost kernels are not scored (kprof makes no roofline claim on them).

Pure functions over text and DataFrames; running ncu is kprof/capture/ncu.py's job.
"""

from __future__ import annotations

import csv
import io
import math
import re

import numpy as np
import pandas as pd

from kprof.analyze import efficiency
from kprof.errors import KprofError

BOUND_PCT = 50.0  # the reference rule's threshold, % of peak
TENSOR_ACTIVE_PCT = 1.0  # a kernel with its tensor pipe busy >= 1% of cycles runs MMA instructions
SECONDS_PER_LAUNCH = 0.4  # ncu kernel replay, ~10 passes per launch (issue 26's budget)
DEFAULT_TOP = 20

# ncu metric names (Nsight Compute's metrics reference, "Metrics Structure": counter__submetric.
# rollup.pct_of_peak_...). The pipes are of active SM cycles, as ncu's own Compute Workload
# Analysis section shows them; DRAM and SM throughput of elapsed cycles, as its Speed Of Light.
METRICS = {
    "duration (ns)": "gpu__time_duration.sum",
    "DRAM %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor HMMA %": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor GMMA %": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "FMA %": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "ALU %": "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
GMMA_CAPABILITY = (9, 0)  # warpgroup MMA (wgmma) exists from Hopper; older GPUs have no such counter

COUNTER_COLUMNS = ["kernel", "launches", "duration (ns)", "DRAM %", "SM %", "tensor %", "FMA %", "ALU %",
                   "occupancy %"]
_TIME_UNITS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9,
               "s": 1e9}


def metrics_for(capability: str | None) -> list[str]:
    """The metric names to ask ncu for on a device of this compute capability ("9.0")."""
    try:
        cap = tuple(int(x) for x in str(capability).split("."))
    except ValueError:
        cap = (0, 0)
    return [m for k, m in METRICS.items() if k != "tensor GMMA %" or cap >= GMMA_CAPABILITY]


def select(by_name: pd.DataFrame, top: int = DEFAULT_TOP) -> pd.DataFrame:
    """The `top` kernel names with the most time per step (kernels.by_name), with the launches
    per step ncu will replay (every launch of those names in one step)."""
    if by_name is None or by_name.empty:
        return pd.DataFrame(columns=["kernel", "time/step (us)", "launches/step"])
    return by_name.head(max(int(top), 0)).reset_index(drop=True)


def estimate_seconds(selected: pd.DataFrame) -> float:
    """ncu's time for one step's launches of the selected kernels at SECONDS_PER_LAUNCH each."""
    if selected is None or selected.empty:
        return 0.0
    return float(np.ceil(pd.to_numeric(selected["launches/step"], errors="coerce").fillna(0)).sum()) * SECONDS_PER_LAUNCH


def _number(s: str) -> float:
    s = (s or "").strip().replace(",", "")
    try:
        return float(s)
    except ValueError:
        return math.nan


def parse_csv(text: str) -> pd.DataFrame:
    """ncu's `--csv --page details` output (one row per metric per kernel launch: "ID",
    "Kernel Name", ..., "Metric Name", "Metric Unit", "Metric Value"; `==PROF==` lines and the
    program's own output may come before the header) -> one row per launch: ID, kernel, block,
    grid, then the METRICS by their short names; durations in ns whatever unit ncu printed, and
    "tensor %" = the larger of the HMMA and GMMA pipes. Thousands separators are removed; "n/a"
    is NaN. Raises KprofError when there is no ncu table in `text`."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"') and '"Metric Name"' in ln), None)
    if start is None:
        raise KprofError("no Nsight Compute table in ncu's output (no \"ID\",...,\"Metric Name\" header); "
                         "run the ncu command kprof printed by hand to see its error")
    reader = csv.DictReader(io.StringIO("\n".join(ln for ln in lines[start:] if ln.startswith('"'))))
    by_short = {m: k for k, m in METRICS.items()}
    rows: dict[str, dict] = {}
    for r in reader:
        lid = r.get("ID", "")
        row = rows.setdefault(lid, {"ID": int(_number(lid)) if math.isfinite(_number(lid)) else -1,
                                    "kernel": r.get("Kernel Name", ""), "block": r.get("Block Size", ""),
                                    "grid": r.get("Grid Size", "")})
        short = by_short.get(r.get("Metric Name", ""))
        if short is None:
            continue
        v = _number(r.get("Metric Value", ""))
        if short == "duration (ns)":
            v *= _TIME_UNITS.get((r.get("Metric Unit") or "nsecond").strip(), math.nan)
        row[short] = v
    out = pd.DataFrame(list(rows.values()))
    for k in METRICS:
        if k not in out:
            out[k] = np.nan
    out["tensor %"] = out[["tensor HMMA %", "tensor GMMA %"]].max(axis=1, skipna=True)
    return out.sort_values("ID", kind="stable").reset_index(drop=True)


def per_kernel(launches: pd.DataFrame) -> pd.DataFrame:
    """Launches of the same kernel name -> one row: launches, total duration (ns), and each
    percentage as the duration-weighted mean over its launches."""
    if launches is None or launches.empty:
        return pd.DataFrame({c: pd.Series(dtype=object if c == "kernel" else float) for c in COUNTER_COLUMNS})
    pcts = ["DRAM %", "SM %", "tensor %", "FMA %", "ALU %", "occupancy %"]
    d = launches.copy()
    w = pd.to_numeric(d["duration (ns)"], errors="coerce").fillna(0.0)
    w = w.where(w > 0, 1.0)  # a launch without a duration still counts, once
    rows = []
    for name, g in d.groupby("kernel", sort=False):
        wg = w[g.index]
        row = {"kernel": name, "launches": len(g), "duration (ns)": float(pd.to_numeric(g["duration (ns)"],
                                                                                          errors="coerce").sum())}
        for c in pcts:
            x = pd.to_numeric(g[c], errors="coerce")
            ok = x.notna()
            row[c] = float((x[ok] * wg[ok]).sum() / wg[ok].sum()) if ok.any() else math.nan
        rows.append(row)
    return pd.DataFrame(rows, columns=COUNTER_COLUMNS)


def reference_class(dram: float, tensor: float, fma: float, alu: float) -> str:
    """The reference rule of the module docstring, on one kernel's counters (percent of peak)."""
    z = (lambda v: 0.0 if v is None or not math.isfinite(v) else float(v))
    dram, tensor, fma, alu = z(dram), z(tensor), z(fma), z(alu)
    pipe = tensor if tensor >= TENSOR_ACTIVE_PCT else max(fma, alu)
    if dram >= BOUND_PCT and dram > pipe:
        return "memory-bound"
    if pipe >= BOUND_PCT and pipe > dram:
        return "compute-bound"
    return "neither"


def kprof_expects(cls: str, under_used: bool) -> str | None:
    """What the reference rule should say for a kernel of this kprof class: its bound, or
    "neither" for latency-bound and under-used kernels; None for classes kprof makes no roofline
    claim on (communication, unknown)."""
    if cls in efficiency.BOUND_CLASSES:
        return "neither" if under_used else cls
    if cls == "latency-bound":
        return "neither"
    return None


def base_name(name: str) -> str:
    """A kernel's function name without "void ", namespaces, template arguments and parameters:
    what ncu prints by default and what a demangled name shares with it."""
    s = re.sub(r"^void\s+", "", str(name).strip())
    depth, out = 0, []
    for ch in s:  # drop everything inside <...> (templates nest)
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).split("(")[0].strip()
    return s.rsplit("::", 1)[-1]


def compare(by_name: pd.DataFrame, counters: pd.DataFrame) -> pd.DataFrame:
    """kprof's view of each selected kernel (kernels.by_name rows) beside ncu's counters
    (per_kernel rows). Names match exactly, else by base_name when that is unique on both sides.

    Columns: kernel, time/step (us), class, under-used, expects (kprof_expects), DRAM %, SM %,
    tensor %, FMA %, ALU %, occupancy %, ncu class (reference_class; "" without counters),
    agree (True/False; None when not scored: no counters, or a class kprof makes no claim on)."""
    cols = ["kernel", "time/step (us)", "class", efficiency.QUALIFIER, "expects", "DRAM %", "SM %", "tensor %",
            "FMA %", "ALU %", "occupancy %", "ncu class", "agree"]
    if by_name is None or by_name.empty:
        return pd.DataFrame(columns=cols)
    c = counters.set_index("kernel") if counters is not None and len(counters) else pd.DataFrame(
        columns=COUNTER_COLUMNS).set_index("kernel")
    base_c = pd.Series(list(c.index), index=[base_name(n) for n in c.index])
    base_k = pd.Series([base_name(n) for n in by_name["kernel"]])
    rows = []
    for _, r in by_name.iterrows():
        name = r["kernel"]
        key = name if name in c.index else None
        b = base_name(name)
        if key is None and (base_c.index == b).sum() == 1 and (base_k == b).sum() == 1:
            key = base_c[b]
        m = c.loc[key] if key is not None else None
        under = bool(r.get(efficiency.QUALIFIER, False))
        exp = kprof_expects(str(r["class"]), under)
        vals = {k: (float(m[k]) if m is not None else math.nan) for k in
                ("DRAM %", "SM %", "tensor %", "FMA %", "ALU %", "occupancy %")}
        ncls = reference_class(vals["DRAM %"], vals["tensor %"], vals["FMA %"], vals["ALU %"]) if m is not None else ""
        rows.append({"kernel": name, "time/step (us)": float(r["time/step (us)"]), "class": r["class"],
                     efficiency.QUALIFIER: under, "expects": exp or "", **vals, "ncu class": ncls,
                     "agree": (exp == ncls) if (m is not None and exp is not None) else None})
    return pd.DataFrame(rows, columns=cols)


def agreement(table: pd.DataFrame) -> dict:
    """Agreement over the scored kernels of `compare`'s table: by count and weighted by kprof's
    time per step. Keys: scored, agree, by count (%), by time (%), not scored."""
    if table is None or table.empty:
        return {"scored": 0, "agree": 0, "by count (%)": None, "by time (%)": None, "not scored": 0}
    s = table[table["agree"].notna()]
    t = pd.to_numeric(s["time/step (us)"], errors="coerce").fillna(0.0)
    ok = s["agree"].astype(bool)
    return {"scored": len(s), "agree": int(ok.sum()),
            "by count (%)": 100.0 * ok.mean() if len(s) else None,
            "by time (%)": 100.0 * t[ok].sum() / t.sum() if t.sum() > 0 else None,
            "not scored": len(table) - len(s)}


def plan(run) -> pd.DataFrame:
    """Per kernel name of a saved run (kprof.store.Run), most time first (kernels.by_name); empty
    for a run without kernels.parquet (a CPU run)."""
    from kprof import store
    from kprof.analyze import kernels

    k = store.load_kernels(run.path)
    return kernels.by_name(k, run.summary.get("steps_recorded") or 1) if k is not None else pd.DataFrame()


def cross_check(run, selected: pd.DataFrame, ncu_path: str, workdir, timeout_s: float | None = None) -> dict:
    """Measure the `selected` kernels (select) of a saved GPU run under ncu, compare them with
    kprof's classes and write ncu.json into the run. Returns the document: the metrics, the
    reference rule, the per-kernel table (compare), the agreement, and the threshold in use."""
    from kprof import store
    from kprof.capture import ncu as capture

    s = run.summary
    metrics = metrics_for((s.get("device") or {}).get("capability"))
    text = capture.run(ncu_path, s["script"], list(s.get("argv") or []), list(selected["kernel"]), metrics,
                       int(s.get("steps_before_timing") or s.get("warmup") or 3), workdir, timeout_s)
    launches = parse_csv(text)
    counters = per_kernel(launches)
    table = compare(selected, counters)
    doc = {"metrics": metrics, "rule": {"bound %": BOUND_PCT, "tensor active %": TENSOR_ACTIVE_PCT},
           "under_used_threshold": efficiency.UNDER_USED_THRESHOLD, "threshold_fitted": False,
           "launches measured": len(launches), "kernels": table.to_dict(orient="records"),
           # the raw counters per kernel name, so a threshold can be re-scored without ncu
           "counters": counters.to_dict(orient="records"),
           "agreement": agreement(table)}
    store.write_json(run.path, store.NCU, doc)
    return doc

"""Roofline analysis: pure functions from DataFrames to DataFrames (no printing; report.py renders).

Inputs are the op table of trace.op_table annotated by costmodel.annotate (device time, FLOPs,
bytes per op execution) and the ceilings of ceilings.py. Column names carry their units.

Classes, checked in this order (the order is the precedence):
1. communication: collectives (c10d / _c10d_functional ops, NCCL kernels). Their time depends on
   the interconnect and the other ranks, not on this device's roofs.
2. latency-bound: device time per launch below `ceilings.latency_us` (on a CPU trace: per call),
   or a cost known to be zero: no FLOPs and no bytes at all (views, allocations: pure overhead).
   Such an op is dominated by fixed per-launch costs; making it faster means launching fewer
   kernels (fusion, CUDA graphs), not moving fewer bytes. Per launch, not per op: a
   multi-tensor op (fused AdamW: 49 launches of ~125 us each, 1B model on an H200) moving
   gigabytes is memory-bound, however many kernels it launches. (That op was once latency-bound
   through the zero-cost rule: the profiler drops the shapes of TensorLists longer than 30, which
   read as empty lists; the cost model now calls such records unknown and trace.op_table
   restores a fused optimizer's shapes, see trace._fill_truncated_optimizer_lists.) Since the
   attainable time is a lower bound of the measured time, a short launch also means little work.
3. unknown: the cost model has no formula for the op.
4. compute-bound if its arithmetic intensity (FLOP/B) is at least the ridge point of its dtype
   class (peak FLOP/s / bandwidth), memory-bound otherwise.

Dtype class of an op (which peak applies): matmul-class ops (costmodel.TENSOR_CORE_OPS) use the
tensor-core peak of their input dtype (bf16, fp16, fp8; fp32 inputs use tf32 if the run allowed
TF32 matmuls, else fp32); every other op uses the CUDA-core fp32 peak.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Sequence

import numpy as np
import pandas as pd

from kprof.analyze.ceilings import Ceilings

CLASSES = ("compute-bound", "memory-bound", "latency-bound", "communication", "unknown")
_COMM_RE = re.compile(r"nccl|^c10d::|^_c10d_functional::|^c10d_functional::|all_?reduce|all_?gather|reduce_?scatter"
                      r"|all_to_all|alltoall|broadcast_", re.IGNORECASE)
_FP8 = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def _first_float_dtype(dtypes) -> str:
    for d in dtypes if isinstance(dtypes, list) else []:
        if isinstance(d, list):
            d = d[0] if d else ""
        if isinstance(d, str) and (d.startswith("float") or d == "bfloat16"):
            return d
    return ""


def dtype_class(dtype: str, tensor_core: bool, tf32: bool = False) -> str:
    """Which peak applies to an op: see the module docstring."""
    if not tensor_core:
        return "fp32"
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "fp16"
    if dtype in _FP8:
        return "fp8"
    return "tf32" if tf32 else "fp32"


def _classify(time_us, launches, flops, bytes_, known, comm, ridge, latency_us: float) -> np.ndarray:
    per_launch = time_us / np.maximum(launches, 1)
    intensity = np.where(bytes_ > 0, flops / np.where(bytes_ > 0, bytes_, 1), np.inf)
    zero_work = known & (np.nan_to_num(flops) == 0) & (np.nan_to_num(bytes_) == 0)
    return np.select(
        [comm, (per_launch < latency_us) | zero_work, ~known, intensity >= ridge],
        ["communication", "latency-bound", "unknown", "compute-bound"],
        default="memory-bound",
    )


def roofline(ops: pd.DataFrame, ceilings: Ceilings, tf32: bool = False) -> pd.DataFrame:
    """Add per op execution: `dtype class`, `intensity (FLOP/B)`, `TFLOP/s`, `GB/s`,
    `attainable (us)` (= max(FLOPs / peak of its dtype class, bytes / bandwidth)),
    `% of roofline` (= attainable / measured) and `class`.

    `tf32`: whether the run allowed TF32 for fp32 matmuls (torch.backends.cuda.matmul.allow_tf32
    or float32 matmul precision "high"/"medium"); default False (fp32 peak)."""
    ops = ops.copy()
    if ops.empty:
        for c in ("dtype class", "intensity (FLOP/B)", "TFLOP/s", "GB/s", "attainable (us)", "% of roofline", "class"):
            ops[c] = pd.Series(dtype=object if c in ("class", "dtype class") else float)
        return ops
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0).to_numpy()
    flops = pd.to_numeric(ops["flops"], errors="coerce").to_numpy(dtype=float)
    bytes_ = pd.to_numeric(ops["bytes"], errors="coerce").to_numpy(dtype=float)
    known = ops["cost_known"].fillna(False).to_numpy(dtype=bool)
    tc = ops["tensor_core"].fillna(False).to_numpy(dtype=bool) if "tensor_core" in ops else np.zeros(len(ops), bool)
    cls = [dtype_class(_first_float_dtype(d), c, tf32) for d, c in zip(ops["input_dtypes"], tc)]
    peak = np.array([ceilings.peak(c) for c in cls]) * 1e12  # FLOP/s
    bw = ceilings.mem_bw_gbs * 1e9  # B/s
    ridge = peak / bw if bw else np.full(len(ops), np.nan)
    attain = np.maximum(np.nan_to_num(flops) / peak, np.nan_to_num(bytes_) / bw) * 1e6
    attain = np.where(known, attain, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        secs = t * 1e-6
        ops["dtype class"] = cls
        ops["intensity (FLOP/B)"] = np.where(known & (bytes_ > 0), flops / bytes_, np.nan)
        ops["TFLOP/s"] = np.where(known & (t > 0), flops / secs / 1e12, np.nan)
        ops["GB/s"] = np.where(known & (t > 0), bytes_ / secs / 1e9, np.nan)
        ops["attainable (us)"] = attain
        ops["% of roofline"] = np.where(t > 0, 100.0 * attain / t, np.nan)
    launches = _launches(ops)
    comm = _is_comm(ops)
    ops["class"] = _classify(t, launches, flops, bytes_, known, comm, ridge, ceilings.latency_us)
    return ops


def _launches(ops: pd.DataFrame) -> np.ndarray:
    """Kernel launches per row; on a CPU trace (no kernels) each row is one call."""
    n = pd.to_numeric(ops["n_kernels"], errors="coerce").fillna(0).to_numpy(dtype=float)
    return np.where(n > 0, n, 1.0)


def _is_comm(ops: pd.DataFrame) -> np.ndarray:
    op = ops["op"].astype(str)
    kernel = ops["kernel"].astype(str) if "kernel" in ops else pd.Series("", index=ops.index)
    # aten has no collectives: its broadcast_tensors, say, is shape arithmetic, not communication
    named = op.str.contains(_COMM_RE) & ~op.str.startswith("aten::")
    return (named | kernel.str.contains("nccl", case=False)).to_numpy()


# ----------------------------------------------------------------------------------------------
# Steps and idle time


def idle_by_step(kernels: pd.DataFrame, step_windows: pd.DataFrame) -> pd.DataFrame:
    """Per step: the device window (trace.step_windows), the time some kernel ran in it (the
    union of kernel intervals on all streams, clipped to the window) and the idle rest.

    Columns: step, window (us), busy (us), idle (us), idle (%)."""
    cols = ["step", "window (us)", "busy (us)", "idle (us)", "idle (%)"]
    if step_windows is None or step_windows.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    w = step_windows.set_index("step")
    start_col = "device start (us)" if "device start (us)" in w else "start (us)"
    end_col = "device end (us)" if "device end (us)" in w else "end (us)"
    ws, we = w[start_col], w[end_col]
    busy = pd.Series(0.0, index=w.index)
    if kernels is not None and not kernels.empty:
        k = kernels[kernels["step"].isin(w.index)].copy()
        k["s"] = np.maximum(k["ts (us)"], k["step"].map(ws))
        k["e"] = np.minimum(k["ts (us)"] + k["dur (us)"], k["step"].map(we))
        k = k[k["e"] > k["s"]].sort_values(["step", "s"])
        # Union of intervals: each one adds what extends past the furthest end seen before it.
        prev_end = k.groupby("step")["e"].cummax().groupby(k["step"]).shift(1)
        k["add"] = (k["e"] - np.maximum(k["s"], prev_end.fillna(-np.inf))).clip(lower=0)
        busy = busy.add(k.groupby("step")["add"].sum(), fill_value=0.0)
    window = (we - ws).clip(lower=0)
    idle = (window - busy).clip(lower=0)
    out = pd.DataFrame({"step": w.index.to_numpy(), "window (us)": window.to_numpy(), "busy (us)": busy.to_numpy(),
                        "idle (us)": idle.to_numpy()})
    out["idle (%)"] = np.where(out["window (us)"] > 0, 100.0 * out["idle (us)"] / out["window (us)"], np.nan)
    return out


def step_basis(busy_us: float, window_us: float, plain_ms: float | None) -> dict:
    """The step every "% of step", busy and idle figure divides by, from the medians over the
    recorded steps of the busy time and the window (idle_by_step) and the unprofiled step's
    median (`plain_ms`).

    The profiler adds host time to every op, so the profiled step runs longer than the real one
    (+105-160% on the H200 workloads with shapes on every step); the kernels take the same time
    either way. So the step is the unprofiled one (or the profiled window, if shorter), busy is
    the recorded device busy time, and idle the rest of the unprofiled step. Without unprofiled
    steps: the profiled window. Keys: step (us), busy (us), idle (us), busy %, basis."""
    plain_us = float(plain_ms) * 1e3 if plain_ms is not None and math.isfinite(float(plain_ms)) else math.nan
    ok_w = math.isfinite(window_us) and window_us > 0
    if math.isfinite(plain_us) and plain_us > 0:
        step, basis = (min(window_us, plain_us) if ok_w else plain_us), "unprofiled step"
    elif ok_w:
        step, basis = window_us, "profiled step"
    else:
        step, basis = math.nan, "none"
    idle = max(step - busy_us, 0.0) if math.isfinite(step) and math.isfinite(busy_us) else math.nan
    pct = min(100.0 * busy_us / step, 100.0) if math.isfinite(step) and step > 0 and math.isfinite(busy_us) else math.nan
    return {"step (us)": step, "busy (us)": busy_us, "idle (us)": idle, "busy %": pct, "basis": basis}


def _median(df: pd.DataFrame | None, col: str) -> float:
    if df is None or df.empty or col not in df:
        return math.nan
    x = pd.to_numeric(df[col], errors="coerce").dropna()
    return float(x.median()) if len(x) else math.nan


def idle_basis(idle: pd.DataFrame | None, plain_ms: float | None) -> dict:
    """step_basis over an idle_by_step table."""
    return step_basis(_median(idle, "busy (us)"), _median(idle, "window (us)"), plain_ms)


def _step_us(ops: pd.DataFrame, n_steps: int, idle: pd.DataFrame | None, plain_ms: float | None = None) -> float:
    """Per-step time the percentages refer to: step_basis's step if known, else the mean summed
    op time (busy time only)."""
    b = idle_basis(idle, plain_ms)
    if math.isfinite(b["step (us)"]) and b["step (us)"] > 0:
        return b["step (us)"]
    return float(pd.to_numeric(ops["device_time (us)"], errors="coerce").sum()) / max(n_steps, 1)


def class_breakdown(ops: pd.DataFrame, idle: pd.DataFrame | None, n_steps: int,
                    plain_ms: float | None = None) -> pd.DataFrame:
    """Device time per class per step, with an "idle" row (the step minus the device busy time).

    Columns: class, time/step (ms), % of step, ops/step. % of step divides by step_basis's step
    (the unprofiled step's median `plain_ms` when given); overlapping streams can make the rows
    add up to more than 100%."""
    n = max(int(n_steps), 1)
    step_us = _step_us(ops, n, idle, plain_ms)
    g = ops.groupby("class")["device_time (us)"].agg(["sum", "size"]) if len(ops) else pd.DataFrame(
        columns=["sum", "size"])
    rows = []
    for c in CLASSES:
        if c in g.index:
            rows.append((c, g.loc[c, "sum"] / n / 1e3, g.loc[c, "size"] / n))
    if idle is not None and not idle.empty:
        rows.append(("idle", idle_basis(idle, plain_ms)["idle (us)"] / 1e3, 0.0))
    out = pd.DataFrame(rows, columns=["class", "time/step (ms)", "ops/step"])
    out["% of step"] = 100.0 * out["time/step (ms)"] * 1e3 / step_us if step_us > 0 else np.nan
    return out[["class", "time/step (ms)", "% of step", "ops/step"]].sort_values(
        "time/step (ms)", ascending=False, kind="stable").reset_index(drop=True)


def _aggregate(ops: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    d = ops.assign(
        _t=pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0),
        _f=pd.to_numeric(ops["flops"], errors="coerce"),
        _b=pd.to_numeric(ops["bytes"], errors="coerce"),
        _a=pd.to_numeric(ops["attainable (us)"], errors="coerce") if "attainable (us)" in ops else np.nan,
        _l=_launches(ops),
        _k=ops["cost_known"].fillna(False).astype(bool),
        _c=_is_comm(ops),
    )
    return d.groupby(keys, sort=False, dropna=False).agg(
        time=("_t", "sum"), flops=("_f", "sum"), bytes=("_b", "sum"), attainable=("_a", "sum"), launches=("_l", "sum"),
        calls=("_t", "size"), known=("_k", "all"), comm=("_c", "any"),
        dtype_class=("dtype class", "first") if "dtype class" in ops else ("_t", "size"),
    ).reset_index()


def top_ops(ops: pd.DataFrame, n_steps: int, k: int | None = 20, ceilings: Ceilings | None = None,
            idle: pd.DataFrame | None = None, plain_ms: float | None = None,
            keys: Sequence[str] = ("module", "op", "shapes", "dtype")) -> pd.DataFrame:
    """The k ops with the most device time (all of them with k=None), grouped by `keys`: (module,
    op, shapes, dtype) by default; the HTML report's roofline groups by (module, op).

    Columns: module, op, shapes, dtype, time/step (ms), % of step, calls/step, TFLOP/s, GB/s,
    intensity (FLOP/B), attainable/step (ms), % of roofline, class. With `ceilings` the class is
    recomputed on the group's totals (time per launch, intensity); without, it is the class most
    of the group's time has. % of step: of step_basis's step if `idle` is given (the unprofiled
    step's median `plain_ms` when given), else of the summed op time per step."""
    keys = list(keys)
    cols = keys + ["time/step (ms)", "% of step", "calls/step", "TFLOP/s", "GB/s", "intensity (FLOP/B)",
                   "attainable/step (ms)", "% of roofline", "class"]
    if ops.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    n = max(int(n_steps), 1)
    step_us = _step_us(ops, n, idle, plain_ms)
    g = _aggregate(ops, keys)
    g = g.sort_values("time", ascending=False, kind="stable")
    g = (g if k is None else g.head(k)).copy()
    known = g["known"].to_numpy(bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        secs = g["time"].to_numpy() * 1e-6
        g["time/step (ms)"] = g["time"] / n / 1e3
        g["% of step"] = 100.0 * g["time"] / n / step_us if step_us > 0 else np.nan
        g["calls/step"] = g["calls"] / n
        g["TFLOP/s"] = np.where(known & (secs > 0), g["flops"] / secs / 1e12, np.nan)
        g["GB/s"] = np.where(known & (secs > 0), g["bytes"] / secs / 1e9, np.nan)
        g["intensity (FLOP/B)"] = np.where(known & (g["bytes"] > 0), g["flops"] / g["bytes"], np.nan)
        g["attainable/step (ms)"] = np.where(known, g["attainable"] / n / 1e3, np.nan)
        g["% of roofline"] = np.where(known & (g["time"] > 0), 100.0 * g["attainable"] / g["time"], np.nan)
    if ceilings is not None:
        ridge = np.array([ceilings.ridge(c) for c in g["dtype_class"].astype(str)])
        g["class"] = _classify(g["time"].to_numpy(), g["launches"].to_numpy(), g["flops"].to_numpy(float),
                               g["bytes"].to_numpy(float), known, g["comm"].to_numpy(bool), ridge, ceilings.latency_us)
    elif "class" in ops:
        dom = (ops.groupby(keys + ["class"], sort=False, dropna=False)["device_time (us)"].sum().reset_index()
               .sort_values("device_time (us)", ascending=False).drop_duplicates(keys))
        g = g.merge(dom[keys + ["class"]], on=keys, how="left")
    else:
        g["class"] = "unknown"
    return g[cols].reset_index(drop=True)


def module_breakdown(ops: pd.DataFrame, n_steps: int, depth: int | None = None) -> pd.DataFrame:
    """Device time per module (its own ops, not its children's), per phase.

    `depth` truncates module paths to their first `depth` components (model.layers.3.mlp ->
    model.layers with depth 2) and sums. Columns: module, fwd (ms/step), bwd (ms/step),
    time/step (ms), % of op time, GFLOP/step, GB/step."""
    cols = ["module", "fwd (ms/step)", "bwd (ms/step)", "time/step (ms)", "% of op time", "GFLOP/step", "GB/step"]
    if ops.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    n = max(int(n_steps), 1)
    mod = ops["module"].astype(str)
    if depth is not None:
        mod = mod.map(lambda m: m if m.startswith("<") else ".".join(m.split(".")[:depth]))
    d = pd.DataFrame({"module": mod, "phase": ops["phase"].astype(str),
                      "t": pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0),
                      "f": pd.to_numeric(ops["flops"], errors="coerce").fillna(0.0),
                      "b": pd.to_numeric(ops["bytes"], errors="coerce").fillna(0.0)})
    by_phase = d.pivot_table(index="module", columns="phase", values="t", aggfunc="sum", fill_value=0.0)
    tot = d.groupby("module")[["t", "f", "b"]].sum()
    out = pd.DataFrame({
        "module": tot.index,
        "fwd (ms/step)": by_phase.get("fwd", pd.Series(0.0, index=tot.index)).reindex(tot.index).to_numpy() / n / 1e3,
        "bwd (ms/step)": by_phase.get("bwd", pd.Series(0.0, index=tot.index)).reindex(tot.index).to_numpy() / n / 1e3,
        "time/step (ms)": tot["t"].to_numpy() / n / 1e3,
        "GFLOP/step": tot["f"].to_numpy() / n / 1e9,
        "GB/step": tot["b"].to_numpy() / n / 1e9,
    })
    total = out["time/step (ms)"].sum()
    out["% of op time"] = 100.0 * out["time/step (ms)"] / total if total > 0 else np.nan
    return out[cols].sort_values("time/step (ms)", ascending=False, kind="stable").reset_index(drop=True)


def coverage(ops: pd.DataFrame) -> float | None:
    """Share (0-1) of device time spent in ops costed by a formula for that op (`cost_known`);
    the generic estimate never counts. None without device time."""
    if ops.empty:
        return None
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0)
    total = float(t.sum())
    if total <= 0:
        return None
    return float(t[ops["cost_known"].fillna(False).astype(bool)].sum()) / total


def estimated_share(ops: pd.DataFrame) -> float | None:
    """Share (0-1) of device time in ops that have only the generic estimate (costmodel's
    `estimated bytes`): outside `coverage`, shown beside it. None without device time."""
    if ops.empty or "estimated bytes" not in ops:
        return None
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0)
    total = float(t.sum())
    if total <= 0:
        return None
    est = ~ops["cost_known"].fillna(False).astype(bool) & pd.to_numeric(ops["estimated bytes"], errors="coerce").notna()
    return float(t[est].sum()) / total


def uncosted(ops: pd.DataFrame, n_steps: int, k: int = 10) -> pd.DataFrame:
    """The k ops with the most device time and no formula, per op name.

    Columns: op, time/step (ms), % of op time, calls/step, estimated GB/step (the generic
    estimate; NaN where not even that was possible)."""
    cols = ["op", "time/step (ms)", "% of op time", "calls/step", "estimated GB/step"]
    if ops.empty:
        return pd.DataFrame({c: pd.Series(dtype=object if c == "op" else float) for c in cols})
    n = max(int(n_steps), 1)
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0)
    total = float(t.sum())
    est = (pd.to_numeric(ops["estimated bytes"], errors="coerce") if "estimated bytes" in ops
           else pd.Series(np.nan, index=ops.index))
    d = pd.DataFrame({"op": ops["op"].astype(str), "t": t, "e": est})[~ops["cost_known"].fillna(False).astype(bool)]
    g = d.groupby("op").agg(t=("t", "sum"), calls=("t", "size"), e=("e", lambda x: x.sum(min_count=1)))
    g = g.sort_values("t", ascending=False, kind="stable").head(k)
    out = pd.DataFrame({"op": g.index, "time/step (ms)": g["t"].to_numpy() / n / 1e3,
                        "% of op time": 100.0 * g["t"].to_numpy() / total if total > 0 else np.nan,
                        "calls/step": g["calls"].to_numpy() / n, "estimated GB/step": g["e"].to_numpy() / n / 1e9})
    return out[cols].reset_index(drop=True)


def step_stats(times: Sequence[float]) -> dict:
    """Median and spread of step times. Spread is p90 - p10 (linear interpolation between order
    statistics, numpy's default); with fewer than 3 steps it is max - min."""
    xs = [float(x) for x in times if x is not None and math.isfinite(float(x))]
    if not xs:
        return {"median": None, "spread": None, "p10": None, "p90": None, "min": None, "max": None,
                "spread_definition": "p90 - p10"}
    p10, p90 = (float(np.percentile(xs, 10)), float(np.percentile(xs, 90))) if len(xs) >= 3 else (min(xs), max(xs))
    return {"median": float(statistics.median(xs)), "spread": p90 - p10, "p10": p10, "p90": p90,
            "min": min(xs), "max": max(xs),
            "spread_definition": "p90 - p10" if len(xs) >= 3 else "max - min (fewer than 3 steps)"}


def overhead(profiled: Sequence[float], unprofiled: Sequence[float]) -> float | None:
    """Profiler overhead as a fraction: median profiled step time / median unprofiled - 1."""
    p, u = step_stats(profiled)["median"], step_stats(unprofiled)["median"]
    if p is None or not u:
        return None
    return p / u - 1.0


# A step whose p90 - p10 exceeds its median, or profiled steps more than 4x (or under half) the
# unprofiled ones, is not the profiler's cost or the script's own variation (the CPU example runs
# at +70% and a spread of half its median on a shared 2-core VM): something else took the machine.
NOISY_SPREAD = 1.0
NONSENSE_OVERHEAD = (-0.5, 3.0)


def timing_warnings(unprofiled: Sequence[float], profiled: Sequence[float]) -> list[str]:
    """Warnings for step times too noisy or too far apart to mean anything (a co-tenant's load
    once gave +9483% overhead with no word of doubt)."""
    out = []
    st = step_stats(unprofiled)
    if st["median"] and st["spread"] is not None and st["spread"] > NOISY_SPREAD * st["median"]:
        out.append(f"the unprofiled step times vary more than their median ({st['min']:.3g} to {st['max']:.3g} ms, "
                   f"median {st['median']:.3g}): another process is probably using this machine, so the step "
                   "figures are unreliable; profile again on a quiet machine, or with more --steps")
    ov = overhead(profiled, unprofiled)
    if ov is not None and not NONSENSE_OVERHEAD[0] <= ov <= NONSENSE_OVERHEAD[1]:
        out.append(f"the profiled steps took {ov * 100:+.0f}% vs the unprofiled ones, far from the profiler's "
                   "usual cost: the machine's load changed during the run, so the % of step figures are "
                   "unreliable; profile again on a quiet machine")
    return out


# ----------------------------------------------------------------------------------------------
# Input pipeline: time spent waiting for data (read by kprof.rules.diagnoses.input_pipeline)


def _merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint union of intervals."""
    if len(starts) == 0:
        return np.zeros(0), np.zeros(0)
    o = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, float)[o], np.asarray(ends, float)[o]
    run_end = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > run_end[:-1]]  # a gap before this interval starts a new block
    block = np.cumsum(new) - 1
    return s[new], pd.Series(run_end).groupby(block).max().to_numpy()


def _covered(bs: np.ndarray, be: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Length of the disjoint intervals (bs, be) lying before each time t."""
    if len(bs) == 0:
        return np.zeros(len(t))
    cum = np.r_[0.0, np.cumsum(be - bs)]
    i = np.searchsorted(bs, t, side="right")  # intervals starting at or before t
    last = np.clip(i - 1, 0, None)
    # the intervals before the last one that started are whole; that one counts up to t
    return cum[last] + np.where(i > 0, np.clip(t - bs[last], 0, be[last] - bs[last]), 0.0)


def _idle_in(starts, ends, bs, be) -> float:
    """Time inside the union of [starts, ends) during which none of the busy intervals ran."""
    s, e = _merge(np.asarray(starts, float), np.asarray(ends, float))
    return float(((e - s) - (_covered(bs, be, e) - _covered(bs, be, s))).sum())


def input_wait_by_step(ranges: pd.DataFrame, kernels: pd.DataFrame | None, steps) -> pd.DataFrame:
    """Per recorded step: the input pipeline's host time (trace.input_ranges) and, on a GPU run
    (`kernels`: every device activity of a GPU trace, trace.TraceEvents.device, with its
    `ts (us)` and `dur (us)`), the device idle time inside it: the part of
    those host intervals when no kernel, memcpy or memset ran on any stream, i.e. the GPU waited
    for the next batch (a DataLoader fetch) or for a blocking copy call to return. `kernels` None
    (CPU run): the idle columns are NaN, there is no device to wait.

    Columns: step, iterator, loader calls, loader (us), loader idle (us), h2d copies, h2d pageable,
    h2d host (us), h2d device (us), h2d idle (us), idle (us) (the union of both). Empty when the
    steps have no DataLoader fetch and no host-to-device copy."""
    cols = ["step", "iterator", "loader calls", "loader (us)", "loader idle (us)", "h2d copies", "h2d pageable",
            "h2d host (us)", "h2d device (us)", "h2d idle (us)", "idle (us)"]
    if ranges is None or ranges.empty:
        return pd.DataFrame({c: pd.Series(dtype=object if c == "iterator" else float) for c in cols})
    gpu = kernels is not None and not kernels.empty
    bs, be = _merge(kernels["ts (us)"].to_numpy(float), (kernels["ts (us)"] + kernels["dur (us)"]).to_numpy(float)) \
        if gpu else (np.zeros(0), np.zeros(0))
    rows = []
    for step in steps:
        r = ranges[ranges["step"] == step]
        lo, hd = r[r["kind"] == "loader"], r[r["kind"] == "h2d"]

        def idle(x: pd.DataFrame) -> float:
            return _idle_in(x["ts (us)"], x["end (us)"], bs, be) if gpu else math.nan

        rows.append({"step": step, "iterator": lo["name"].iloc[0] if len(lo) else "",
                     "loader calls": len(lo), "loader (us)": float(lo["dur (us)"].sum()), "loader idle (us)": idle(lo),
                     "h2d copies": len(hd), "h2d pageable": int(hd["name"].str.contains("Pageable").sum()),
                     "h2d host (us)": float(hd["dur (us)"].sum()),
                     "h2d device (us)": float(pd.to_numeric(hd["device (us)"], errors="coerce").sum()),
                     "h2d idle (us)": idle(hd), "idle (us)": idle(r)})
    return pd.DataFrame(rows, columns=cols)

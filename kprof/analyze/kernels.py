"""Every kernel its own row: the per-kernel table of a GPU run (kernels.parquet) and its top rows.

trace.op_table keeps one row per op execution, summing its kernels' time and naming only the
longest kernel, so a cuBLAS split-K reduce, cuDNN's helper kernels or the embedding backward's
sort and scan never show. kernel_table gives each kernel (memcpy, memset) of the recorded steps
a row of its own, attributed to its op and module (trace.kernel_rows), with its own time.

FLOPs and bytes: the cost model counts them per op. An op's cost is split across its kernels in
proportion to their time (a kernel's share = its time / the op's device time). So the split
keeps each op's totals, and every kernel of an op gets the op's intensity and % of roofline;
what differs between them is their time per launch (latency-bound) and their grid (the
`under-used` causes). The rule is a stated approximation: which kernel of a split-K matmul does
the FLOPs is not in the trace.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kprof.analyze import efficiency, trace
from kprof.analyze import tables as analysis
from kprof.analyze.ceilings import Ceilings

# Columns carried from the op's row to each of its kernels.
_FROM_OP = ["input_shapes", "input_dtypes", "input_strides", "shapes", "dtype", "cost_known", "tensor_core"]


def kernel_table(events: trace.TraceEvents, ops: pd.DataFrame, ceilings: Ceilings,
                 sm_count: float | None = None) -> pd.DataFrame:
    """One row per kernel per recorded step (trace.kernel_rows' columns) with `op time share`,
    `flops` and `bytes` (the op's, split by time share), the roofline columns of tables.roofline,
    the class, and `under-used` / `causes` (efficiency.qualify). `ops`: the costed op table
    (costmodel.annotate, then tables.roofline) of the same trace. Empty on a CPU run."""
    k = trace.kernel_rows(events)
    if k.empty or ops is None or ops.empty or "row_id" not in ops:
        return k
    o = ops.drop_duplicates("row_id").set_index("row_id")
    rid = k["row_id"]
    op_time = pd.to_numeric(rid.map(o["device_time (us)"]), errors="coerce").to_numpy(dtype=float)
    dur = k["dur (us)"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(op_time > 0, dur / op_time, np.nan)
    k["op time share"] = share
    for c in ("flops", "bytes"):
        k[c] = pd.to_numeric(rid.map(o[c]), errors="coerce").to_numpy(dtype=float) * share if c in o else np.nan
    for c in _FROM_OP:
        if c in o:
            k[c] = rid.map(o[c]).tolist()
    k["cost_known"] = k.get("cost_known", pd.Series(False, index=k.index)).fillna(False).astype(bool)
    k["tensor_core"] = k.get("tensor_core", pd.Series(False, index=k.index)).fillna(False).astype(bool)
    for c in ("input_shapes", "input_dtypes", "input_strides"):
        if c not in k:
            k[c] = [[] for _ in range(len(k))]
        k[c] = [v if isinstance(v, list) else [] for v in k[c]]
    k["device_time (us)"] = dur
    k["n_kernels"] = 1
    k = analysis.roofline(k, ceilings, tf32=False)
    return efficiency.qualify(k, gpu=True, sm_count=sm_count)


def op_grid_causes(kernels: pd.DataFrame) -> pd.Series:
    """Per op-table row (index: row_id): the grid causes of its kernels, ", "-joined, from the
    kernels that are themselves under-used, so that an op shows what its slow kernels show."""
    if kernels is None or kernels.empty or "causes" not in kernels:
        return pd.Series(dtype=object)
    grid = kernels["causes"].astype(str).map(
        lambda s: ", ".join(c for c in s.split(", ") if c in ("small grid", "tail")))
    g = grid[grid != ""].groupby(kernels.loc[grid != "", "row_id"]).agg(lambda xs: ", ".join(sorted(set(", ".join(
        xs).split(", ")))))
    return g


def top_kernels(kernels: pd.DataFrame, n_steps: int, k: int = 20, step_us: float | None = None) -> pd.DataFrame:
    """The k kernels with the most time, one row per (kernel, op): the modules that ran it
    (grouped, `model.layers.*.mlp x 8`), time per step, % of step (of `step_us`, the step
    tables.step_basis gives), launches per step, GB/s, % of roofline, the class by time
    (the class most of its time has), `under-used` (most of its time is) and the causes.

    Columns: kernel, op, modules, time/step (ms), % of step, launches/step, TFLOP/s, GB/s,
    % of roofline, class, under-used, causes."""
    cols = ["kernel", "op", "modules", "time/step (ms)", "% of step", "launches/step", "TFLOP/s", "GB/s",
            "% of roofline", "class", efficiency.QUALIFIER, "causes"]
    if kernels is None or kernels.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    from kprof.analyze.modules import group_paths

    n = max(int(n_steps), 1)
    d = kernels.assign(_t=pd.to_numeric(kernels["device_time (us)"], errors="coerce").fillna(0.0),
                       _f=pd.to_numeric(kernels["flops"], errors="coerce"),
                       _b=pd.to_numeric(kernels["bytes"], errors="coerce"),
                       _a=pd.to_numeric(kernels["attainable (us)"], errors="coerce"),
                       _u=kernels[efficiency.QUALIFIER].astype(bool))
    keys = ["kernel", "op"]
    g = d.groupby(keys, sort=False).agg(t=("_t", "sum"), f=("_f", lambda x: x.sum(min_count=1)),
                                        b=("_b", lambda x: x.sum(min_count=1)),
                                        a=("_a", lambda x: x.sum(min_count=1)), launches=("_t", "size"))
    g = g.sort_values("t", ascending=False, kind="stable").head(k).reset_index()
    dom = (d.groupby(keys + ["class"], sort=False)["_t"].sum().reset_index()
           .sort_values("_t", ascending=False, kind="stable").drop_duplicates(keys))
    g = g.merge(dom[keys + ["class"]], on=keys, how="left")
    under_t = d[d["_u"]].groupby(keys)["_t"].sum()
    causes = d[d["_u"]].groupby(keys)["causes"].agg(lambda xs: ", ".join(
        c for c in efficiency.CAUSES if any(c in str(x).split(", ") for x in xs)))
    mods = d.groupby(keys)["module"].agg(lambda ms: _modules(group_paths(sorted(set(map(str, ms))))))
    idx = pd.MultiIndex.from_frame(g[keys])
    with np.errstate(divide="ignore", invalid="ignore"):
        secs = g["t"].to_numpy() * 1e-6
        out = pd.DataFrame({
            "kernel": g["kernel"], "op": g["op"], "modules": mods.reindex(idx).to_numpy(),
            "time/step (ms)": g["t"] / n / 1e3,
            "% of step": 100.0 * g["t"] / n / step_us if step_us and step_us > 0 else np.nan,
            "launches/step": g["launches"] / n,
            "TFLOP/s": np.where(secs > 0, g["f"] / secs / 1e12, np.nan),
            "GB/s": np.where(secs > 0, g["b"] / secs / 1e9, np.nan),
            "% of roofline": np.where(g["t"] > 0, 100.0 * g["a"] / g["t"], np.nan),
            "class": g["class"],
            efficiency.QUALIFIER: under_t.reindex(idx).fillna(0.0).to_numpy() > g["t"].to_numpy() / 2,
            "causes": causes.reindex(idx).fillna("").to_numpy(),
        })
    out.loc[~out[efficiency.QUALIFIER], "causes"] = ""
    return out[cols].reset_index(drop=True)


def _modules(groups: list[tuple[str, int]], most: int = 2) -> str:
    parts = [f"{p} x {c}" if c > 1 else (p or "<root>") for p, c in groups[:most]]
    if len(groups) > most:
        parts.append(f"+{len(groups) - most} more")
    return ", ".join(parts)


def by_name(kernels: pd.DataFrame, n_steps: int) -> pd.DataFrame:
    """Per kernel name, most time first: time/step (us), launches/step, the class most of its time
    has, whether most of its time is under-used, and `tensor_core` (any of its ops is
    matmul-class). The unit Nsight Compute reports by, so the unit of the ncu cross-check."""
    cols = ["kernel", "time/step (us)", "launches/step", "class", efficiency.QUALIFIER, "tensor_core"]
    if kernels is None or kernels.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in cols})
    n = max(int(n_steps), 1)
    d = kernels.assign(_t=pd.to_numeric(kernels["device_time (us)"], errors="coerce").fillna(0.0))
    d = d[d["cat"].astype(str) == "kernel"] if "cat" in d else d
    g = d.groupby("kernel", sort=False).agg(t=("_t", "sum"), launches=("_t", "size"),
                                            tc=("tensor_core", "any") if "tensor_core" in d else ("_t", "size"))
    dom = (d.groupby(["kernel", "class"], sort=False)["_t"].sum().reset_index()
           .sort_values("_t", ascending=False, kind="stable").drop_duplicates("kernel").set_index("kernel")["class"])
    under = d[d[efficiency.QUALIFIER].astype(bool)].groupby("kernel")["_t"].sum()
    out = pd.DataFrame({"kernel": g.index, "time/step (us)": g["t"].to_numpy() / n,
                        "launches/step": g["launches"].to_numpy() / n,
                        "class": dom.reindex(g.index).to_numpy(),
                        efficiency.QUALIFIER: under.reindex(g.index).fillna(0.0).to_numpy() > g["t"].to_numpy() / 2,
                        "tensor_core": g["tc"].astype(bool).to_numpy() if "tensor_core" in d else False})
    return out.sort_values("time/step (us)", ascending=False, kind="stable").reset_index(drop=True)[cols]

"""Where the memory goes: the breakdown of allocated memory at the step's peak, and its timeline.

Pure functions over DataFrames. The input is one step's allocation events, from either source:

* the profiler's memory events of the shapes step (`events_from_record`, every run, CPU too):
  `Total Allocated` after each event comes with it;
* the CUDA allocator's history (`events_from_snapshot`, the dict `torch.cuda.memory._snapshot()`
  returns): `alloc` / `free_completed` entries of `device_traces`, replayed backwards from the
  blocks live in `segments` at the snapshot, so memory allocated before the window is known too.

Both give an events frame (t_us, addr, bytes: + alloc / - free, total_allocated, total_reserved),
which `blocks` turns into one row per allocation (alloc and free event index, size). The live
blocks at the peak event are classified (`classify`), by identity first:

1. parameters, optimizer state, gradients: the block holds the data_ptr of one of the model's
   tensors (listed by the runner at the step's end; at its start for memory that was already
   live before the step);
2. activations: allocated in the forward (before the first backward node) and still live when
   the backward starts, charged to the innermost module range open at allocation;
3. temporaries: anything else allocated in the step;
4. other (before the step): live before the step and none of the model's tensors.

The categories sum to the allocated memory at the peak by construction; fragmentation is the
reserved memory minus the allocated at that moment. Times are microseconds since the Unix epoch
in both sources and in the ranges (module forwards, backward nodes, the optimizer step).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

MODULE_PREFIX = "kprof.module:"
BWD_PREFIX = "autograd::engine::evaluate_function:"
OPTIM_STEP_PREFIX = "Optimizer.step#"
STEP_RANGE = "kprof.shapes_step#0"
OUTSIDE = "<outside modules>"
UNSEEN = -1  # addr of the row standing for memory live before the window that no event shows

CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "temporaries",
              "other (before the step)")
EVENT_COLUMNS = ["t_us", "addr", "bytes", "total_allocated", "total_reserved"]
TIMELINE_POINTS = 120  # points kept in summary.json; each is the max of its bin, so the peak stays


# --------------------------------------------------------------------------------------------
# Sources -> events


def events_from_record(record: dict) -> pd.DataFrame:
    """The profiler's memory events of a memory record (kprof/capture/runner.py `_memory_record`)."""
    df = pd.DataFrame(record.get("events") or [], columns=EVENT_COLUMNS)
    return df.sort_values("t_us", kind="stable").reset_index(drop=True)


def events_from_snapshot(snapshot: dict, device: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(events, live blocks at the snapshot) of one device of a `torch.cuda.memory._snapshot()`.

    Allocated memory counts a block from `alloc` to `free_completed` (a block awaiting a free on
    another stream is still allocated, as `torch.cuda.memory_allocated` counts it); reserved
    memory follows `segment_alloc` / `segment_free` (and `segment_map` / `segment_unmap` with
    expandable segments). Both are replayed backwards from the snapshot's segments."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    segs = [s for s in snapshot.get("segments") or [] if s.get("device", device) == device]
    live = [(b["address"], b["size"], b.get("frames") or []) for s in segs for b in s.get("blocks") or []
            if b.get("state") in ("active_allocated", "active_awaiting_free")]
    live_df = pd.DataFrame(live, columns=["addr", "size", "frames"])
    reserved_end = sum(int(s.get("total_size") or 0) for s in segs)
    rows, res = [], []
    for e in trace:
        a = e.get("action")
        t = float(e.get("time_us") or 0)
        if a == "alloc":
            rows.append((t, int(e["addr"]), int(e["size"]), e.get("frames") or []))
            res.append(0)
        elif a == "free_completed":
            rows.append((t, int(e["addr"]), -int(e["size"]), e.get("frames") or []))
            res.append(0)
        elif a in ("segment_alloc", "segment_map", "segment_free", "segment_unmap"):
            sign = 1 if a in ("segment_alloc", "segment_map") else -1
            if rows:  # reserved changes ride on the previous allocation event
                res[-1] += sign * int(e["size"])
            else:
                reserved_end -= sign * int(e["size"])  # before the first event: part of the start
    ev = pd.DataFrame(rows, columns=["t_us", "addr", "bytes", "frames"])
    allocated_end = int(live_df["size"].sum()) if len(live_df) else 0
    start = allocated_end - int(ev["bytes"].sum())
    ev["total_allocated"] = start + ev["bytes"].cumsum()
    res_arr = np.asarray(res, dtype=np.int64)
    ev["total_reserved"] = (reserved_end - int(res_arr.sum())) + np.cumsum(res_arr) if len(res_arr) else []
    return ev[EVENT_COLUMNS + ["frames"]], live_df


# --------------------------------------------------------------------------------------------
# Events -> blocks


def blocks(events: pd.DataFrame, live_at_end: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per allocation: addr, size, i_alloc / i_free (event indexes; -1: before the
    window, len(events): still live at its end), t_alloc (NaN before the window), frames.

    Memory live before the window shows up as a free without an alloc, as a block live at the
    end that the window never allocated (`live_at_end`, from a snapshot), or not at all; the
    last is one row at addr UNSEEN sized so that the blocks at the first event sum to its
    `total_allocated` (the profiler source, where the model's tensors then split it up)."""
    n = len(events)
    addr = events["addr"].to_numpy()
    size = events["bytes"].to_numpy()
    t = events["t_us"].to_numpy(dtype=float)
    frames = events["frames"].tolist() if "frames" in events else [None] * n
    out: list[list] = []
    open_: dict[int, int] = {}
    for i in range(n):
        a = int(addr[i])
        if size[i] > 0:
            open_[a] = len(out)
            out.append([a, int(size[i]), i, n, t[i], frames[i]])
        elif size[i] < 0:
            j = open_.pop(a, None)
            if j is not None:
                out[j][3] = i
            else:
                out.append([a, int(-size[i]), -1, i, math.nan, None])
    if live_at_end is not None:
        for a, s, fr in zip(live_at_end["addr"], live_at_end["size"], live_at_end["frames"]):
            if int(a) not in open_:
                out.append([int(a), int(s), -1, n, math.nan, fr])
    df = pd.DataFrame(out, columns=["addr", "size", "i_alloc", "i_free", "t_alloc", "frames"])
    if n and live_at_end is None:
        before = int(events["total_allocated"].iloc[0] - events["bytes"].iloc[0])
        unseen = before - int(df.loc[df["i_alloc"] < 0, "size"].sum())
        if unseen > 0:
            df.loc[len(df)] = [UNSEEN, unseen, -1, n, math.nan, None]
    return df


def split_unseen(bl: pd.DataFrame, tensors: list[list]) -> pd.DataFrame:
    """Replace the UNSEEN row by rows for the given tensors ([ptr, nbytes, ...], listed at the
    step's start) that no block holds, and what is left of it; no tensor gets more than it has."""
    mask = bl["addr"] == UNSEEN
    if not mask.any():
        return bl
    left = int(bl.loc[mask, "size"].sum())
    n = int(bl["i_free"].max()) if len(bl) else 0
    held = _owner(bl[~mask], np.array([int(e[0]) for e in tensors], dtype=np.int64)) if tensors else []
    rows, seen = [], set()
    for e, h in zip(tensors, held):
        ptr, nbytes = int(e[0]), int(e[1])
        if h >= 0 or ptr in seen or left <= 0:
            continue
        seen.add(ptr)
        take = min(nbytes, left)
        rows.append([ptr, take, -1, n, math.nan, None])
        left -= take
    if left > 0:
        rows.append([UNSEEN, left, -1, n, math.nan, None])
    return pd.concat([bl[~mask], pd.DataFrame(rows, columns=bl.columns)], ignore_index=True)


def _owner(bl: pd.DataFrame, ptrs: np.ndarray) -> np.ndarray:
    """For each pointer, the index label (in `bl`) of the block holding it, or -1."""
    if not len(bl) or not len(ptrs):
        return np.full(len(ptrs), -1, dtype=np.int64)
    s = bl.sort_values("addr")
    starts = s["addr"].to_numpy(dtype=np.int64)
    ends = starts + s["size"].to_numpy(dtype=np.int64)
    k = np.searchsorted(starts, ptrs, side="right") - 1
    ok = (k >= 0) & (ptrs < ends[np.clip(k, 0, None)])
    labels = s.index.to_numpy()
    return np.where(ok, labels[np.clip(k, 0, None)], -1)


# --------------------------------------------------------------------------------------------
# Ranges: the step's phases and module attribution


def ranges_frame(record: dict) -> pd.DataFrame:
    """The record's ranges as a frame: name, t0, t1, tid, seq."""
    return pd.DataFrame(record.get("ranges") or [], columns=["name", "t0", "t1", "tid", "seq"])


def phases(ranges: pd.DataFrame) -> dict:
    """The step's phase bounds (us since the epoch, NaN where absent): start, forward end (the
    first backward node; else the last outermost module's end), optimizer start, end."""
    r = ranges
    step = r[r["name"] == STEP_RANGE]
    mods = r[r["name"].str.startswith(MODULE_PREFIX)]
    bwd = r[r["name"].str.startswith(BWD_PREFIX)]
    opt = r[r["name"].str.startswith(OPTIM_STEP_PREFIX)]
    start = float(step["t0"].min()) if len(step) else (float(r["t0"].min()) if len(r) else math.nan)
    end = float(step["t1"].max()) if len(step) else (float(r["t1"].max()) if len(r) else math.nan)
    fwd_end = float(bwd["t0"].min()) if len(bwd) else (float(mods["t1"].max()) if len(mods) else math.nan)
    return {"start": start, "forward_end": fwd_end, "model_forward_end": float(mods["t1"].max()) if len(mods) else math.nan,
            "optimizer_start": float(opt["t0"].min()) if len(opt) else math.nan, "end": end}


def innermost_module(ranges: pd.DataFrame, t: np.ndarray) -> np.ndarray:
    """The module path of the innermost module range open at each time (OUTSIDE where none)."""
    mods = ranges[ranges["name"].str.startswith(MODULE_PREFIX)].sort_values("t0", kind="stable")
    out = np.full(len(t), OUTSIDE, dtype=object)
    for name, t0, t1 in zip(mods["name"], mods["t0"], mods["t1"]):
        inside = (t >= t0) & (t < t1)  # later starts are nested deeper: they overwrite
        if inside.any():
            out[inside] = module_path(name)
    return out


def module_path(range_name: str) -> str:
    path = range_name[len(MODULE_PREFIX):].rsplit(":", 1)[0]
    return path or "<root>"


def moment(t: float, ranges: pd.DataFrame, forward_ops: pd.DataFrame | None = None) -> tuple[str, str]:
    """(phase, words) for the moment `t`: "optimizer step", "forward: <module>", "forward end",
    "backward of <module>" (the backward node running then, mapped to its forward op's module
    through its sequence number), "backward", or "outside the step"."""
    ph = phases(ranges)
    opt = ranges[ranges["name"].str.startswith(OPTIM_STEP_PREFIX)]
    if ((opt["t0"] <= t) & (t <= opt["t1"])).any():
        return "optimizer", "optimizer step"
    if not math.isnan(ph["start"]) and t < ph["start"]:
        return "outside", "outside the step"
    if math.isnan(ph["forward_end"]) or t < ph["forward_end"]:
        if not math.isnan(ph["model_forward_end"]) and t >= ph["model_forward_end"]:
            return "forward", "forward end (loss)"
        return "forward", f"forward: {innermost_module(ranges, np.array([t]))[0]}"
    bwd = ranges[ranges["name"].str.startswith(BWD_PREFIX) & (ranges["t0"] <= t) & (t <= ranges["t1"])]
    if len(bwd):
        node = bwd.assign(d=bwd["t1"] - bwd["t0"]).sort_values("d").iloc[0]
        if forward_ops is not None and len(forward_ops) and node["seq"] >= 0:
            f = forward_ops[forward_ops["seq"] == node["seq"]]
            if len(f):
                mod = innermost_module(ranges, f["t_us"].to_numpy(dtype=float)[:1])[0]
                return "backward", f"backward of {mod}"
        return "backward", f"backward ({node['name'][len(BWD_PREFIX):].strip()})"
    if not math.isnan(ph["optimizer_start"]) and t >= ph["optimizer_start"]:
        return "optimizer", "after the optimizer step"
    return "backward", "backward"


# --------------------------------------------------------------------------------------------
# Classification and the breakdown


def classify(bl: pd.DataFrame, tensors: dict, ranges: pd.DataFrame) -> pd.DataFrame:
    """`bl` with `category` and `module` (activations only) columns. `tensors` is the runner's
    {"at_forward_start": {kind: entries}, "at_step_end": {kind: entries}}, kinds "parameters",
    "gradients", "optimizer_state"."""
    bl = bl.copy()
    n_end = int(bl["i_free"].max()) if len(bl) else 0
    cat = np.full(len(bl), "", dtype=object)
    pos = {label: i for i, label in enumerate(bl.index)}
    kinds = (("parameters", "parameters"), ("optimizer_state", "optimizer state"), ("gradients", "gradients"))
    for when, alive in (("at_step_end", bl["i_free"] >= n_end), ("at_forward_start", bl["i_alloc"] < 0)):
        cand = bl[alive & (bl["addr"] != UNSEEN)]
        for kind, label in kinds:
            entries = (tensors.get(when) or {}).get(kind) or []
            owners = _owner(cand, np.array([int(e[0]) for e in entries], dtype=np.int64))
            for o in owners:
                if o >= 0 and not cat[pos[o]]:
                    cat[pos[o]] = label
    ph = phases(ranges)
    t_alloc = bl["t_alloc"].to_numpy(dtype=float)
    fwd_end = ph["forward_end"]
    in_fwd = ~np.isnan(t_alloc) & (t_alloc < fwd_end if not math.isnan(fwd_end) else True)
    bl["category"] = cat
    bl["module"] = ""
    bl["_fwd"] = in_fwd
    bl.loc[(bl["category"] == "") & (bl["i_alloc"] < 0), "category"] = "other (before the step)"
    rest = bl["category"] == ""
    bl.loc[rest & bl["_fwd"], "category"] = "activations"
    bl.loc[rest & ~bl["_fwd"], "category"] = "temporaries"
    act = (bl["category"] == "activations").to_numpy()
    bl.loc[act, "module"] = innermost_module(ranges, t_alloc[act])
    return bl.drop(columns="_fwd")


def live_at(bl: pd.DataFrame, i: int) -> pd.DataFrame:
    """The blocks live just after event `i`."""
    return bl[(bl["i_alloc"] <= i) & (bl["i_free"] > i)]


def activations_saved(bl: pd.DataFrame, events: pd.DataFrame, ranges: pd.DataFrame) -> pd.DataFrame:
    """The activations (category) live when the backward starts, i.e. saved for backward, with
    their module; at the forward's end if there is no backward."""
    fwd_end = phases(ranges)["forward_end"]
    t = events["t_us"].to_numpy(dtype=float)
    i = int(np.searchsorted(t, fwd_end, side="left")) - 1 if not math.isnan(fwd_end) else len(t) - 1
    live = live_at(bl, i)
    return live[live["category"] == "activations"]


def layer_of(path: str) -> str:
    """The repeated block a module belongs to: the path up to its last numeric component
    (`model.layers.3.mlp.up_proj` -> `model.layers.3`), else the path itself."""
    parts = path.split(".")
    for k in range(len(parts) - 1, -1, -1):
        if parts[k].isdigit():
            return ".".join(parts[: k + 1])
    return path


def by_module(act: pd.DataFrame, top: int | None = None) -> pd.DataFrame:
    """Activation bytes per module (innermost), largest first."""
    if not len(act):
        return pd.DataFrame(columns=["module", "layer", "bytes", "blocks"])
    g = act.groupby("module", sort=False)["size"].agg(["sum", "count"]).reset_index()
    g.columns = ["module", "bytes", "blocks"]
    g.insert(1, "layer", g["module"].map(layer_of))
    g = g.sort_values(["bytes", "module"], ascending=[False, True], kind="stable").reset_index(drop=True)
    return g.head(top) if top else g


def timeline(events: pd.DataFrame, start: float, points: int = TIMELINE_POINTS) -> pd.DataFrame:
    """Allocated memory over the step: at most `points` rows (ms since `start`, allocated bytes),
    each the maximum of its bin, so the peak is kept."""
    if not len(events):
        return pd.DataFrame(columns=["ms", "allocated"])
    ms = (events["t_us"].to_numpy(dtype=float) - start) / 1e3
    alloc = events["total_allocated"].to_numpy(dtype=np.int64)
    if len(ms) <= points:
        return pd.DataFrame({"ms": ms, "allocated": alloc})
    edges = np.linspace(ms.min(), ms.max(), points + 1)
    b = np.clip(np.searchsorted(edges, ms, side="right") - 1, 0, points - 1)
    df = pd.DataFrame({"b": b, "ms": ms, "allocated": alloc})
    idx = df.groupby("b")["allocated"].idxmax()
    return df.loc[idx, ["ms", "allocated"]].reset_index(drop=True)


def breakdown(events: pd.DataFrame, ranges: pd.DataFrame, tensors: dict,
              forward_ops: pd.DataFrame | None = None, live_at_end: pd.DataFrame | None = None,
              top_modules: int = 30) -> dict:
    """The memory section of summary.json: the peak, what it is made of, the activations saved
    per module, fragmentation at the peak, the timeline and the peak's moment."""
    if not len(events):
        return {}
    bl = blocks(events, live_at_end)
    start_tensors = tensors.get("at_forward_start") or {}
    bl = split_unseen(bl, [*start_tensors.get("parameters", []), *start_tensors.get("optimizer_state", []),
                           *start_tensors.get("gradients", [])])
    bl = classify(bl, tensors, ranges)
    alloc = events["total_allocated"].to_numpy(dtype=np.int64)
    k = int(np.argmax(alloc))
    t_peak = float(events["t_us"].iloc[k])
    live = live_at(bl, k)
    cats = live.groupby("category")["size"].sum()
    ph = phases(ranges)
    start = ph["start"] if not math.isnan(ph["start"]) else float(events["t_us"].iloc[0])
    phase, words = moment(t_peak, ranges, forward_ops)
    reserved = int(events["total_reserved"].iloc[k])
    saved = by_module(activations_saved(bl, events, ranges))
    at_peak = by_module(live[live["category"] == "activations"])

    def ms(t: float) -> float | None:
        return None if math.isnan(t) else (t - start) / 1e3

    return {
        "peak_bytes": int(alloc[k]),
        "peak_ms": ms(t_peak),
        "peak_phase": phase,
        "peak_moment": words,
        "categories": {c: int(cats.get(c, 0)) for c in CATEGORIES},
        "categories_sum": int(cats.sum()),
        "reserved_bytes": reserved if reserved > 0 else None,
        "fragmentation_bytes": max(reserved - int(alloc[k]), 0) if reserved > 0 else None,
        "activations_at_peak": at_peak.head(top_modules).to_dict(orient="records"),
        "activations_saved": saved.head(top_modules).to_dict(orient="records"),
        "activations_saved_bytes": int(saved["bytes"].sum()) if len(saved) else 0,
        "phases_ms": {"forward_end": ms(ph["forward_end"]), "optimizer_start": ms(ph["optimizer_start"]),
                      "end": ms(ph["end"])},
        "timeline": timeline(events, start).to_dict(orient="records"),
        "tensors": tensor_totals(tensors),
    }


def tensor_totals(tensors: dict) -> dict:
    """Bytes and bytes per dtype of each kind of the model's tensors (unique storages), at the
    step's end, and the gradients already live at the forward's start."""
    out = {}
    end = tensors.get("at_step_end") or {}
    for kind in ("parameters", "gradients", "optimizer_state"):
        out[kind] = _totals(end.get(kind) or [])
    out["gradients_at_forward_start"] = _totals((tensors.get("at_forward_start") or {}).get("gradients") or [])
    return out


def _totals(entries: list) -> dict:
    seen: dict[int, tuple[int, str]] = {}
    for e in entries:
        seen.setdefault(int(e[0]), (int(e[1]), str(e[3]) if len(e) > 3 else "?"))
    by_dtype: dict[str, int] = {}
    for nbytes, dt in seen.values():
        by_dtype[dt] = by_dtype.get(dt, 0) + nbytes
    return {"bytes": sum(by_dtype.values()), "count": len(seen), "by_dtype": by_dtype}


def from_record(record: dict, snapshot: dict | None = None) -> dict:
    """The breakdown of a runner's memory record; from the allocator snapshot when the profiler
    recorded no events for the device (`source` says which)."""
    ranges = ranges_frame(record)
    fwd = pd.DataFrame(record.get("forward_ops") or [], columns=["t_us", "seq", "tid"])
    tensors = record.get("tensors") or {}
    events, live, source = events_from_record(record), None, "profiler memory events (shapes step)"
    if not len(events) and snapshot is not None:
        events, live = events_from_snapshot(snapshot)
        source = "CUDA allocator history (shapes step)"
    elif len(events) and record.get("device") == "cpu":
        # The CPU allocator's `Total Allocated` counts from the profiler's start (0 before the
        # step: the tiny MLP's 0.5 MB of parameters read as 0), so the model's tensors live at the
        # step's start are added as the memory before the window.
        start = tensors.get("at_forward_start") or {}
        known = sum(v["bytes"] for k, v in tensor_totals({"at_step_end": start}).items()
                    if k in ("parameters", "gradients", "optimizer_state"))
        events = events.assign(total_allocated=events["total_allocated"] + known)
    out = breakdown(events, ranges, tensors, fwd, live)
    if not out:
        return {}
    cuda = record.get("cuda") or {}
    out |= {"source": source, "device": record.get("device"), "max_allocated": cuda.get("max_allocated"),
            "max_reserved": cuda.get("max_reserved")}
    return out


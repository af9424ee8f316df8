"""Read a torch.profiler Chrome trace and turn it into one row per executed op per recorded step.

The runner (kprof/capture/runner.py) emits the names this module parses:

- `kprof.step#<n>`: a range spanning exactly one recorded step (0-based n).
- `kprof.shapes_step#0`: the profiler warm-up step, the one step recorded with op shapes. The
  recorded steps are timed without shapes (recording them adds host time to every op), and each
  of their ops takes the shapes of the op at the same place in this step (`_shapes_from_shapes_step`).
- `kprof.module:<path>:<Class>`: a range around every module's forward; `<path>` is the name in
  `named_modules()` of the root ("" for the root itself).
- backward ops sit inside torch's `autograd::engine::evaluate_function: XBackward0` ranges, which
  carry the `Sequence number` of the forward op that created the autograd node;
- optimizer work sits inside torch's own `Optimizer.step#<Class>.step` range.

Which level of the op tree carries the time:
- GPU trace: each kernel (and memcpy/memset) belongs to the innermost op enclosing its launch
  (the host event with the same `correlation` arg, whatever its name: cudaLaunchKernel,
  cuLaunchKernelEx, cudaMemcpyAsync, ...), so
  an op's device time is the summed duration of the kernels it launched itself. Kernels launched
  outside any op (Triton kernels called straight from Python, NCCL) keep the module/phase of the
  range around their launch and take the kernel name as their op. Device activity launched
  before the recording started (the previous step's tail, still running on the device) is not
  part of any step: see `_device_steps`.
- CPU-only trace (no device activity at all): every op's self CPU time (its duration minus that
  of the ops nested directly in it), so nothing is counted twice.

In both cases a row also records `parent_id`: the nearest enclosing op that is itself a row, so
that the cost model can charge each row only the work its children did not (see costmodel.py).

Timestamps are parsed to integer nanoseconds so that nesting tests are exact, then reported in
microseconds relative to the first event, in columns named with their unit.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kprof.errors import KprofError

STEP_PREFIX = "kprof.step#"
SHAPES_STEP = "kprof.shapes_step#0"
MODULE_PREFIX = "kprof.module:"
BWD_PREFIX = "autograd::engine::evaluate_function:"
OPTIM_PREFIX = "Optimizer."  # torch's own "Optimizer.step#AdamW.step" / "Optimizer.zero_grad#..."

OPTIMIZER = "<optimizer>"
UNATTRIBUTED = "<unattributed>"

# Chrome-trace categories written by Kineto (torch/csrc/profiler/kineto_shim.cpp and
# libkineto's ActivityType names): device activity, and the host-side calls that launch it.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Host ranges that are not part of the host nesting tree (they live on device timelines).
SKIP_CATS = ("gpu_user_annotation", "ac2g", "Trace", "overhead")

# An op is a dispatcher op "namespace::name" (aten::mm, kprof::rms_norm_fwd, c10d::allreduce_).
# Not ops: "autograd::engine::evaluate_function: ...", "torch::autograd::AccumulateGrad" (two
# namespaces), autograd node ranges ("MmBackward0"), record_function ranges.
_OP_RE = re.compile(r"^(?!autograd::)[A-Za-z_]\w*::[A-Za-z_]\w*$")
# Inductor's generated kernels are ops too: the range around a Triton launch is named after the
# kernel (triton_poi_fused_add_0), a C++ kernel's range (cpp.enable_kernel_profile, which the
# runner turns on) "graph_<id>_cpp_fused_...". kprof/analyze/compiled.py attributes them.
INDUCTOR_KERNEL_RE = re.compile(r"^(?:graph_\d+_)?(?:cpp|triton)_\w+$")

# Kineto's element-type names (c10 TypeMeta names, checked against torch 2.13's profiler output in
# tests/profile/test_trace.py) -> torch dtype names.
TRACE_DTYPES: dict[str, str] = {
    "float": "float32",
    "double": "float64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "long int": "int64",
    "long": "int64",
    "int": "int32",
    "short int": "int16",
    "short": "int16",
    "signed char": "int8",
    "unsigned char": "uint8",
    "bool": "bool",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "c10::complex<c10::Half>": "complex32",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2": "float8_e5m2",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz",
    "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "c10::Float8_e8m0fnu": "float8_e8m0fnu",
}

SHORT_DTYPES = {
    "float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "fp8e4m3", "float8_e5m2": "fp8e5m2", "float8_e4m3fnuz": "fp8e4m3fnuz",
    "float8_e5m2fnuz": "fp8e5m2fnuz",
}

OP_COLUMNS = [
    "step", "module", "module_class", "phase", "op", "input_shapes", "input_dtypes", "input_strides",
    "concrete_inputs", "input_types", "shapes", "dtype", "device_time (us)", "n_kernels", "kernel",
    "op_id", "parent_id", "ts (us)", "dur (us)", "tid", "called_op", "row_id",
]


@dataclass
class TraceEvents:
    """The trace as tables. Times are in microseconds since the first event of the trace.

    host: every host range (ops, annotations, runtime calls) with its nesting context.
    device: kernels, memcpys and memsets with the host event that launched them.
    steps: one row per `kprof.step#<n>` range.
    """

    host: pd.DataFrame
    device: pd.DataFrame
    steps: pd.DataFrame
    device_type: str  # "cuda" if the trace has any device activity, else "cpu"
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Loading


def _read_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise KprofError(f"trace file {p} does not exist; re-run `kprof profile` to record one")
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as e:
        raise KprofError(f"could not read trace {p} ({e}); it may be truncated. Re-run `kprof profile`.") from e
    if isinstance(data, list):  # the JSON array form of the Chrome trace format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise KprofError(f"{p} is not a Chrome trace (no traceEvents); pass the trace kprof profile wrote")
    return data


def _ns(values) -> np.ndarray:
    # ts/dur are microseconds with 3 decimals; rounding to integer ns makes nesting exact.
    return np.rint(np.asarray(values, dtype=np.float64) * 1000.0).astype(np.int64)


def load_trace(path: str | Path) -> TraceEvents:
    """Load a Chrome trace JSON (plain or .gz) written by torch.profiler."""
    data = _read_json(path)
    xs = [e for e in data["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    meta = {k: v for k, v in data.items() if k != "traceEvents"}
    empty = pd.DataFrame({"name": pd.Series(dtype=str), "cat": pd.Series(dtype=str)})
    if not xs:
        return _assemble(empty, meta)
    df = pd.DataFrame.from_records(
        [(e.get("name", ""), e.get("cat", ""), e.get("pid", 0), e.get("tid", 0), e["ts"], e.get("dur", 0),
          e.get("args") or {}) for e in xs],
        columns=["name", "cat", "pid", "tid", "ts", "dur", "args"],
    )
    df["start_ns"] = _ns(df["ts"])
    df["end_ns"] = df["start_ns"] + _ns(df["dur"].fillna(0))
    df = df.drop(columns=["ts", "dur"])
    return _assemble(df, meta)


def _assemble(df: pd.DataFrame, meta: dict) -> TraceEvents:
    if df.empty:
        cols = ["name", "cat", "start_ns", "end_ns"]
        host = pd.DataFrame(columns=cols)
        return TraceEvents(_host_table(host, 0), _device_table(pd.DataFrame(columns=cols), host, 0),
                           _steps_table(host, 0), "cpu", meta)
    t0 = int(df["start_ns"].min())
    cat = df["cat"].astype(str)
    dev_mask = cat.isin(DEVICE_CATS)
    host_mask = ~dev_mask & ~cat.isin(SKIP_CATS)
    host = _nest(df[host_mask].reset_index(drop=True))
    device = _device_table(df[dev_mask].reset_index(drop=True), host, t0)
    steps = _steps_table(host, t0)
    return TraceEvents(_host_table(host, t0), device, steps, "cuda" if len(device) else "cpu", meta)


# ----------------------------------------------------------------------------------------------
# Host nesting: one stack pass per thread


def _nest(host: pd.DataFrame) -> pd.DataFrame:
    """Annotate each host event with its nesting context.

    Columns added: is_op, op_parent (row of the nearest enclosing op or -1), module (row of the
    innermost enclosing kprof.module range or -1), bwd (row of the innermost enclosing
    evaluate_function range or -1), optim (inside an Optimizer.* range), self_ns (duration minus
    that of the ops whose op_parent it is).

    Events on one thread are properly nested (RecordFunction scopes), so sorting a thread's events
    by (start, longest first) puts each parent before its children and one stack pass finds them.
    Step ranges are not part of the tree: steps are assigned by time (backward runs on other
    threads on GPU).
    """
    n = len(host)
    if n == 0:
        for c in ("is_op", "optim"):
            host[c] = pd.Series(dtype=bool)
        for c in ("op_parent", "module", "bwd", "self_ns"):
            host[c] = pd.Series(dtype=np.int64)
        return host
    names = host["name"].astype(str)
    cats = host["cat"].astype(str)
    is_op = ((names.str.match(_OP_RE) | names.str.match(INDUCTOR_KERNEL_RE)) & (cats == "cpu_op")).to_numpy()
    is_mod = names.str.startswith(MODULE_PREFIX).to_numpy()
    is_bwd = names.str.startswith(BWD_PREFIX).to_numpy()
    is_opt = names.str.startswith(OPTIM_PREFIX).to_numpy()
    is_step = names.str.startswith(STEP_PREFIX).to_numpy()

    op_parent = np.full(n, -1, np.int64)
    module = np.full(n, -1, np.int64)
    bwd = np.full(n, -1, np.int64)
    optim = np.zeros(n, bool)
    child_ns = np.zeros(n, np.int64)
    start = host["start_ns"].to_numpy()
    end = host["end_ns"].to_numpy()
    dur = end - start

    order = np.lexsort((np.arange(n), -dur, start, host["tid"].astype(str).to_numpy(),
                        host["pid"].astype(str).to_numpy()))
    pids = host["pid"].astype(str).to_numpy()
    tids = host["tid"].astype(str).to_numpy()
    stack: list[int] = []
    prev_thread = None
    for i in order:
        if is_step[i]:
            continue
        thread = (pids[i], tids[i])
        if thread != prev_thread:
            stack, prev_thread = [], thread
        s = start[i]
        while stack and end[stack[-1]] <= s:
            stack.pop()
        if stack:
            p = stack[-1]
            # The parent's context, then this event's own contribution to it.
            op_parent[i] = p if is_op[p] else op_parent[p]
            module[i] = module[p]
            bwd[i] = bwd[p]
            optim[i] = optim[p]
        if is_mod[i]:
            module[i] = i
        elif is_bwd[i]:
            bwd[i] = i
        elif is_opt[i]:
            optim[i] = True
        if is_op[i] and op_parent[i] >= 0:
            child_ns[op_parent[i]] += dur[i]
        stack.append(i)
    host["is_op"] = is_op
    host["op_parent"] = op_parent
    host["module"] = module
    host["bwd"] = bwd
    host["optim"] = optim
    host["self_ns"] = np.maximum(dur - child_ns, 0)
    return host


def _arg(args: pd.Series, key: str, default=None) -> pd.Series:
    return args.map(lambda a: a.get(key, default) if isinstance(a, dict) else default)


def _host_table(host: pd.DataFrame, t0: int) -> pd.DataFrame:
    host = host.copy()
    host["ts (us)"] = (host["start_ns"] - t0) / 1e3 if len(host) else pd.Series(dtype=float)
    host["dur (us)"] = (host["end_ns"] - host["start_ns"]) / 1e3 if len(host) else pd.Series(dtype=float)
    return host


def _device_table(dev: pd.DataFrame, host: pd.DataFrame, t0: int) -> pd.DataFrame:
    """Kernels/memcpys/memsets, each with the host row of its launch (`launch`, -1 if unknown)."""
    cols = ["name", "cat", "start_ns", "end_ns", "ts (us)", "dur (us)", "stream", "device", "correlation", "launch"]
    if dev.empty:
        out = pd.DataFrame({c: pd.Series(dtype=object if c in ("name", "cat") else float) for c in cols})
        out["args"] = pd.Series(dtype=object)
        return out
    dev = dev.copy()
    args = dev["args"]
    dev["correlation"] = pd.to_numeric(_arg(args, "correlation"), errors="coerce")
    dev["external_id"] = pd.to_numeric(_arg(args, "External id"), errors="coerce")
    dev["stream"] = _arg(args, "stream").fillna(dev["tid"])
    dev["device"] = _arg(args, "device").fillna(dev["pid"])
    dev["launch"] = -1
    if len(host):
        # Any host event carrying a `correlation` arg is a launch, whatever its name or category:
        # cudaLaunchKernel (cuda_runtime), cuLaunchKernelEx / cuLaunchKernel (cuda_driver: how
        # cuBLAS' nvjet and cuDNN's SDPA kernels are launched under CUDA 13), cudaMemcpyAsync,
        # cudaLaunchCooperativeKernel... A name allow-list misses the next one CUDA adds.
        corr = pd.to_numeric(_arg(host["args"], "correlation"), errors="coerce")
        rt = corr[corr.notna() & ~host["is_op"].to_numpy()]
        by_corr = pd.Series(rt.index.to_numpy(), index=rt.to_numpy())
        by_corr = by_corr[~by_corr.index.duplicated(keep="first")]
        launch = dev["correlation"].map(by_corr)
        # No runtime event (runtime activity not recorded): fall back on the External id, which
        # Kineto sets to the id of the op that was current at the launch.
        ops = host[host["is_op"]]
        ext = pd.to_numeric(_arg(ops["args"], "External id"), errors="coerce")
        by_ext = pd.Series(ops.index.to_numpy(), index=ext.to_numpy())
        by_ext = by_ext[~by_ext.index.isna() & ~by_ext.index.duplicated(keep="last")]
        launch = launch.fillna(dev["external_id"].map(by_ext))
        dev["launch"] = launch.fillna(-1).astype(np.int64)
    dev["ts (us)"] = (dev["start_ns"] - t0) / 1e3
    dev["dur (us)"] = (dev["end_ns"] - dev["start_ns"]) / 1e3
    return dev[cols + ["external_id", "args"]].reset_index(drop=True)


def _steps_table(host: pd.DataFrame, t0: int) -> pd.DataFrame:
    cols = ["step", "start_ns", "end_ns", "start (us)", "end (us)"]
    if host.empty:
        return pd.DataFrame({c: pd.Series(dtype=np.int64 if c != "start (us)" and c != "end (us)" else float)
                             for c in cols})
    names = host["name"].astype(str)
    st = host[names.str.startswith(STEP_PREFIX)].copy()
    st["step"] = pd.to_numeric(st["name"].str.slice(len(STEP_PREFIX)), errors="coerce")
    st = st.dropna(subset=["step"])
    st["step"] = st["step"].astype(np.int64)
    # One range per step; if a step was emitted twice (two threads), keep the widest window.
    st = st.groupby("step", as_index=False).agg(start_ns=("start_ns", "min"), end_ns=("end_ns", "max"))
    st["start (us)"] = (st["start_ns"] - t0) / 1e3
    st["end (us)"] = (st["end_ns"] - t0) / 1e3
    return st[cols].sort_values("step").reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Step assignment


def _step_of(ns: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """Index of the step window [start, end) containing each time, or -1."""
    if steps.empty or len(ns) == 0:
        return np.full(len(ns), -1, np.int64)
    starts = steps["start_ns"].to_numpy()
    ends = steps["end_ns"].to_numpy()
    pos = np.searchsorted(starts, ns, side="right") - 1
    ok = (pos >= 0) & (ns < ends[np.clip(pos, 0, None)])
    return np.where(ok, steps["step"].to_numpy()[np.clip(pos, 0, None)], -1)


def _device_steps(events: TraceEvents) -> np.ndarray:
    """Recorded step of each device activity (-1: none), by when it was launched.

    Linked activity (its launch event is in the trace): the step whose host window contains the
    launch. Unlinked activity: on a GPU the host runs ahead, so when the profiler starts
    recording, the device is still executing the previous (unrecorded) step's kernels: they
    appear in the trace, inside step 0's window by device time, with no launch event (measured on
    an H200, Llama 1B: 844 such kernels, 47 ms, the whole backward + AdamW of the profiler
    warm-up step, all landing in step 0). Their CUPTI correlation ids, which grow with every
    launch in the process, place them: an unlinked activity takes the step of the linked one
    with the nearest lower correlation id, and none (-1) if every linked activity came later
    (launched before the recording). Only without any linked activity or correlation id does
    the device start time decide.
    """
    d = events.device
    if d.empty:
        return np.zeros(0, np.int64)
    host = events.host
    launch = d["launch"].to_numpy()
    linked = launch >= 0
    hl = np.clip(launch, 0, None)
    launch_ns = host["start_ns"].to_numpy()[hl] if len(host) else np.zeros(len(d), np.int64)
    step = np.where(linked, _step_of(np.where(linked, launch_ns, 0), events.steps),
                    _step_of(d["start_ns"].to_numpy(), events.steps))
    corr = pd.to_numeric(d["correlation"], errors="coerce").to_numpy(dtype=float)
    ref = linked & ~np.isnan(corr)
    if ref.any():
        order = np.argsort(corr[ref], kind="stable")
        ref_corr = corr[ref][order]
        ref_step = step[ref][order]
        todo = ~linked & ~np.isnan(corr)
        pos = np.searchsorted(ref_corr, corr[todo], side="right") - 1
        step[todo] = np.where(pos >= 0, ref_step[np.clip(pos, 0, None)], -1)
    return step


def step_windows(events: TraceEvents) -> pd.DataFrame:
    """Per recorded step: the host window and the device window.

    The device window of step n runs from the first device activity launched in step n to the
    first one launched in step n+1 (for the last step: to the later of its last activity's end and
    the host window's end). Device work lags the host, so idle time is measured in this window,
    not in the host one. On a CPU-only trace the device window is the host window.
    """
    st = events.steps
    out = pd.DataFrame({
        "step": st["step"].to_numpy(),
        "start (us)": st["start (us)"].to_numpy(),
        "end (us)": st["end (us)"].to_numpy(),
        "host (ms)": (st["end (us)"] - st["start (us)"]).to_numpy() / 1e3,
    })
    k = kernel_table(events)
    if events.device_type == "cpu" or k.empty:
        out["device start (us)"] = out["start (us)"]
        out["device end (us)"] = out["end (us)"]
    else:
        g = k.groupby("step").agg(first=("ts (us)", "min"), last=("end (us)", "max"))
        first = out["step"].map(g["first"])
        last = out["step"].map(g["last"])
        nxt = first.shift(-1)
        out["device start (us)"] = first.fillna(out["start (us)"])
        out["device end (us)"] = nxt.fillna(np.maximum(last.fillna(out["end (us)"]), out["end (us)"]))
    out["device (ms)"] = (out["device end (us)"] - out["device start (us)"]) / 1e3
    return out


def kernel_table(events: TraceEvents) -> pd.DataFrame:
    """The busy intervals of the device, per recorded step: `step`, `name`, `ts (us)`,
    `dur (us)`, `end (us)`, `stream`.

    GPU trace: every kernel/memcpy/memset, assigned to the step in which it was launched.
    CPU-only trace: the outermost op ranges (on every thread), the CPU's equivalent of busy time.
    """
    if events.device_type == "cuda":
        d = events.device
        out = pd.DataFrame({"step": _device_steps(events), "name": d["name"].to_numpy(),
                            "ts (us)": d["ts (us)"].to_numpy(), "dur (us)": d["dur (us)"].to_numpy(),
                            "stream": d["stream"].to_numpy()})
    else:
        h = events.host
        if h.empty:
            return pd.DataFrame(columns=["step", "name", "ts (us)", "dur (us)", "end (us)", "stream"])
        top = h[h["is_op"] & (h["op_parent"] < 0)]
        out = pd.DataFrame({"step": _step_of(top["start_ns"].to_numpy(), events.steps),
                            "name": top["name"].to_numpy(), "ts (us)": top["ts (us)"].to_numpy(),
                            "dur (us)": top["dur (us)"].to_numpy(), "stream": top["tid"].to_numpy()})
    out["end (us)"] = out["ts (us)"] + out["dur (us)"]
    out = out[out["step"] >= 0]
    return out[["step", "name", "ts (us)", "dur (us)", "end (us)", "stream"]].sort_values("ts (us)").reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# The op table


def _parse_module(name: str) -> tuple[str, str]:
    body = name[len(MODULE_PREFIX):]
    path, _, cls = body.rpartition(":")
    return path, cls


def _norm_types(types, dims, shape_dtype: dict) -> list:
    """Trace element types -> torch dtype names for tensors; lists of them for TensorLists
    (whose element dtype the trace does not record: inferred from `shape_dtype`)."""
    out = []
    for i, t in enumerate(types or []):
        if t in TRACE_DTYPES:
            out.append(TRACE_DTYPES[t])
        elif t == "TensorList":
            shapes = dims[i] if dims and i < len(dims) and isinstance(dims[i], list) else []
            out.append([shape_dtype.get(tuple(s), "float32") for s in shapes])
        else:
            out.append(t)
    return out


def _display(dims, dtypes) -> tuple[str, str]:
    parts, seen = [], []
    for d, t in zip(dims or [], dtypes or []):
        if isinstance(t, list):
            parts.append(f"[{len(t)} tensors]")
            for x in t:
                if x not in seen:
                    seen.append(x)
        elif t in SHORT_DTYPES or t in TRACE_DTYPES.values():
            parts.append("[" + ", ".join(str(x) for x in d) + "]")
            if t not in seen:
                seen.append(t)
    return ", ".join(parts), "/".join(SHORT_DTYPES.get(t, t) for t in seen)


def _shape_dtypes(host: pd.DataFrame) -> dict:
    """shape -> dtype of the parameters, from the gradients AccumulateGrad received (the trace
    does not record the element type of TensorList arguments such as the optimizer's)."""
    m = host["name"].astype(str) == "torch::autograd::AccumulateGrad"
    out: dict = {}
    for a in host.loc[m, "args"]:
        dims, types = a.get("Input Dims") or [], a.get("Input type") or []
        if dims and types and types[0] in TRACE_DTYPES:
            out.setdefault(tuple(dims[0]), TRACE_DTYPES[types[0]])
    return out


# Fused optimizers: (TensorList arguments that hold one tensor per parameter, shaped like it;
# the 0-d per-parameter step counts; the amsgrad-only list). Schema order of
# aten::_fused_adam(w)_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, ...)
# and aten::_fused_sgd_(params, grads, momentum_buffer_list, ...).
_FUSED_OPTIMIZER_LISTS = {"_fused_adam_": ((0, 1, 2, 3), 5, 4), "_fused_adamw_": ((0, 1, 2, 3), 5, 4),
                          "_fused_sgd_": ((0, 1), None, None)}


def _contiguous(shape: list) -> list:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(int(n), 1)
    return st[::-1]


def _fill_truncated_optimizer_lists(rows: pd.DataFrame, events: TraceEvents) -> None:
    """Give a fused optimizer call its parameter shapes when the profiler dropped them.

    The profiler records no shapes for a TensorList longer than 30 tensors (`Input Dims` [] per
    list: any model past a toy; the H200 Llama-1B run's _fused_adamw_ over 75 parameters cost
    6 ms/step with no shapes). The parameters it updates are those that received a gradient in
    the step: one `torch::autograd::AccumulateGrad` per parameter per backward pass, with the
    gradient's shape and dtype. With k forward calls of the root module in the step (gradient
    accumulation), each parameter appears k times: the counts are divided by k, and the lists
    are left empty (cost unknown) if they are not all multiples of k. Only filled when one call
    of that op has truncated lists in the step (more calls: param groups, whose split is not
    in the trace), minus the parameters of that op's calls whose lists were recorded.
    SGD's momentum buffer list is not filled (it is empty without momentum): its bytes are left out.
    """
    ops = rows["op"].astype(str).str.replace("aten::", "", regex=False)
    cand = ops.isin(list(_FUSED_OPTIMIZER_LISTS)) & (rows["phase"] == "optim")
    if not cand.any():
        return
    host = events.host
    names = host["name"].astype(str)
    acc = host[names == "torch::autograd::AccumulateGrad"]
    acc_step = _step_of(acc["start_ns"].to_numpy(), events.steps)
    root = host[names.str.startswith(MODULE_PREFIX + ":")]
    root_calls = pd.Series(_step_of(root["start_ns"].to_numpy(), events.steps)).value_counts()

    def truncated(r) -> bool:
        lists = [d for d, t in zip(r["input_shapes"], r["input_types"]) if t == "TensorList"]
        return bool(lists) and all(not d for d in lists)

    for (step, op), idx in rows[cand].groupby([rows.loc[cand, "step"], ops[cand]]).groups.items():
        bad = [i for i in idx if truncated(rows.loc[i])]
        if len(bad) != 1:
            continue
        grads: dict[tuple, int] = {}
        for s, a in zip(acc_step, acc["args"]):
            dims, types = a.get("Input Dims") or [], a.get("Input type") or []
            if s == step and dims and types and types[0] in TRACE_DTYPES:
                key = (tuple(dims[0]), TRACE_DTYPES[types[0]])
                grads[key] = grads.get(key, 0) + 1
        k = int(root_calls.get(step, 1)) or 1
        if not grads or any(n % k for n in grads.values()):
            continue
        params = {key: n // k for key, n in grads.items()}
        for i in idx:  # calls whose lists were recorded update other parameters
            if i in bad:
                continue
            d, t = rows.at[i, "input_shapes"], rows.at[i, "input_dtypes"]
            if d and isinstance(t[0], list):
                for shape, dt in zip(d[0], t[0]):
                    key = (tuple(shape), dt)
                    if params.get(key, 0) > 0:
                        params[key] -= 1
        flat = [(list(sh), dt) for (sh, dt), n in params.items() for _ in range(n)]
        if not flat:
            continue
        per_param, steps_list, ams_list = _FUSED_OPTIMIZER_LISTS[op]
        i = bad[0]
        dims = list(rows.at[i, "input_shapes"])
        dtypes = list(rows.at[i, "input_dtypes"])
        strides = list(rows.at[i, "input_strides"]) + [[] for _ in range(len(dims) - len(rows.at[i, "input_strides"]))]
        conc = list(rows.at[i, "concrete_inputs"])
        amsgrad = ams_list is not None and len(conc) > 11 and str(conc[11]).lower() == "true"
        fill = list(per_param) + ([ams_list] if amsgrad else [])
        for j in fill:
            if j < len(dims):
                dims[j] = [sh for sh, _ in flat]
                dtypes[j] = [dt for _, dt in flat]
                strides[j] = [_contiguous(sh) for sh, _ in flat]
        if steps_list is not None and steps_list < len(dims):
            dims[steps_list] = [[] for _ in flat]
            dtypes[steps_list] = ["float32"] * len(flat)
            strides[steps_list] = [[] for _ in flat]
        rows.at[i, "input_shapes"] = dims
        rows.at[i, "input_dtypes"] = dtypes
        rows.at[i, "input_strides"] = strides


_SHAPE_ARGS = ("Input Dims", "Input type", "Input Strides", "Concrete Inputs")


def _shapes_from_shapes_step(host: pd.DataFrame, steps: pd.DataFrame, names: np.ndarray, owner: np.ndarray,
                             phase: np.ndarray, is_op: np.ndarray) -> np.ndarray:
    """The host rows' args, where an op of a recorded step without shapes takes those of the op
    at the same place in the shapes step: same phase, module range, op name and occurrence
    (k-th such op in its step, in time order). An op without a counterpart (the step ran other
    ops: data-dependent control flow) keeps no shapes, so its cost is unknown; `op_table`'s
    caller sees it in coverage. Ops whose shapes change between steps with the same sequence of
    ops (MoE dispatch, packed sequences) would get the shapes step's: profile with
    shapes_every_step (RunConfig) for those. A trace without a shapes step is returned as is."""
    args = host["args"].to_numpy().copy()
    win = host[names == SHAPES_STEP]
    if win.empty:
        return args
    start, end = int(win["start_ns"].min()), int(win["end_ns"].max())
    t = host["start_ns"].to_numpy()
    # AccumulateGrad too: its gradient shapes fill in a fused optimizer's truncated lists
    is_op = is_op | (names == "torch::autograd::AccumulateGrad")
    in_shapes = is_op & (t >= start) & (t < end)
    step = _step_of(t, steps)
    mod = np.where(owner >= 0, owner, -1)
    mod_name = np.array([names[o] if o >= 0 else "" for o in mod], dtype=object)
    k = pd.DataFrame({"w": np.where(in_shapes, -2, step), "ph": phase, "m": mod_name, "n": names, "t": t})
    k = k[is_op & (in_shapes | (step >= 0))]
    k["i"] = k.sort_values("t", kind="stable").groupby(["w", "ph", "m", "n"], sort=False).cumcount()
    ref = k[k["w"] == -2]
    src = dict(zip(zip(ref["ph"], ref["m"], ref["n"], ref["i"]), ref.index))
    for row, key in zip(k.index[k["w"] >= 0], zip(*(k.loc[k["w"] >= 0, c] for c in ("ph", "m", "n", "i")))):
        a = args[row] if isinstance(args[row], dict) else {}
        j = src.get(key)
        if "Input Dims" in a or j is None:
            continue
        b = args[j]
        args[row] = a | {c: b[c] for c in _SHAPE_ARGS if c in b}
    return args


def op_table(events: TraceEvents) -> pd.DataFrame:
    """One row per executed op per recorded step (see the module docstring for which ops).

    Columns: step, module (path; "" the root; "<optimizer>"; "<unattributed>"), module_class,
    phase ("fwd" | "bwd" | "optim" | "other"), op, input_shapes, input_dtypes (torch dtype names
    for tensors, the trace's type name otherwise), input_strides, concrete_inputs, input_types
    (raw), shapes and dtype (display strings), device time (us), n_kernels, kernel (longest),
    op_id / parent_id (host row ids; parent_id is -1 or another row's op_id), ts (us), dur (us), tid,
    called_op, row_id (the row's id in the trace, which kernel_rows' rows name: see row_key).
    """
    host = events.host
    if host.empty or events.steps.empty:
        return _empty_ops()
    names = host["name"].astype(str).to_numpy()
    is_op = host["is_op"].to_numpy()
    module, module_class, phase, owner = _host_context(events, names)

    if events.device_type == "cuda":
        rows = _gpu_rows(events, names)
    else:
        rows = _cpu_rows(events)
    return _finish_rows(rows, events, names, is_op, module, module_class, phase, owner)


def _host_context(events: TraceEvents, names: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per host row: module path, module class, phase, and the module range row that owns it
    (-1: none)."""
    host = events.host
    seq = pd.to_numeric(_arg(host["args"], "Sequence number"), errors="coerce").to_numpy()

    # Module of every host row: forward context first; backward rows through the sequence number
    # of their evaluate_function range, looked up among forward ops (sequence numbers grow
    # monotonically per thread for the life of the process, so one forward op owns each; ops
    # nested in a composite op share its number and its module).
    mod_idx = host["module"].to_numpy()
    bwd_idx = host["bwd"].to_numpy()
    optim = host["optim"].to_numpy()
    is_op = host["is_op"].to_numpy()
    fwd_mask = is_op & (bwd_idx < 0) & (mod_idx >= 0) & ~np.isnan(seq)
    seq_module = dict(zip(seq[fwd_mask].astype(np.int64), mod_idx[fwd_mask]))
    bwd_seq = np.where(bwd_idx >= 0, seq[np.clip(bwd_idx, 0, None)], np.nan)
    via_seq = np.array([seq_module.get(int(s), -1) if not np.isnan(s) else -1 for s in bwd_seq], np.int64)
    # Inside backward, a module range still wins (activation checkpointing re-runs forwards there).
    owner = np.where(mod_idx >= 0, mod_idx, np.where(bwd_idx >= 0, via_seq, -1))

    mod_names = {i: _parse_module(names[i]) for i in np.unique(owner[owner >= 0])}
    module = np.array([mod_names[o][0] if o >= 0 else UNATTRIBUTED for o in owner], dtype=object)
    module_class = np.array([mod_names[o][1] if o >= 0 else "" for o in owner], dtype=object)
    phase = np.where(optim, "optim", np.where(bwd_idx >= 0, "bwd", np.where(mod_idx >= 0, "fwd", "other")))
    module = np.where(optim, OPTIMIZER, module)
    module_class = np.where(optim, "", module_class)
    return module, module_class, phase, owner


def _finish_rows(rows: pd.DataFrame, events: TraceEvents, names: np.ndarray, is_op: np.ndarray, module: np.ndarray,
                 module_class: np.ndarray, phase: np.ndarray, owner: np.ndarray) -> pd.DataFrame:
    host = events.host
    if rows.empty:
        return _empty_ops()
    h = rows["host_row"].to_numpy()
    valid = h >= 0
    hh = np.clip(h, 0, None)
    rows["module"] = np.where(valid, module[hh], UNATTRIBUTED)
    rows["module_class"] = np.where(valid, module_class[hh], "")
    rows["phase"] = np.where(valid, phase[hh], "other")
    rows.loc[valid & ~is_op[hh], "op"] = rows.loc[valid & ~is_op[hh], "kernel"]  # launched outside any op

    args = _shapes_from_shapes_step(host, events.steps, names, owner, phase, is_op)
    host = host.assign(args=args)
    events = TraceEvents(host, events.device, events.steps, events.device_type, events.meta)
    shape_dtype = _shape_dtypes(host)
    empty: dict = {}
    a_rows = [args[i] if v and is_op[i] else empty for i, v in zip(hh, valid)]
    dims = [a.get("Input Dims") or [] for a in a_rows]
    types = [a.get("Input type") or [] for a in a_rows]
    rows["input_shapes"] = dims
    rows["input_types"] = types
    rows["input_dtypes"] = [_norm_types(t, d, shape_dtype) for t, d in zip(types, dims)]
    rows["input_strides"] = [a.get("Input Strides") or [] for a in a_rows]
    rows["concrete_inputs"] = [a.get("Concrete Inputs") or [] for a in a_rows]
    _fill_truncated_optimizer_lists(rows, events)
    disp = [_display(d, t) for d, t in zip(rows["input_shapes"], rows["input_dtypes"])]
    rows["shapes"] = [d[0] for d in disp]
    rows["dtype"] = [d[1] for d in disp]
    rows["ts (us)"] = np.where(valid, host["ts (us)"].to_numpy()[hh], rows["ts (us)"])
    rows["dur (us)"] = np.where(valid, host["dur (us)"].to_numpy()[hh], rows["dur (us)"])
    rows["tid"] = np.where(valid, host["tid"].to_numpy()[hh], -1)
    rows["op_id"] = np.where(valid & is_op[hh], h, -1)

    # parent_id: nearest enclosing op that is itself a row (GPU rows exist only for ops that
    # launched device work, so walk up past ops that did not).
    in_table = set(rows.loc[rows["op_id"] >= 0, "op_id"].tolist())
    op_parent = host["op_parent"].to_numpy()

    def table_parent(i: int) -> int:
        p = op_parent[i]
        while p >= 0 and p not in in_table:
            p = op_parent[p]
        return int(p)

    rows["parent_id"] = [table_parent(i) if i >= 0 else -1 for i in rows["op_id"]]
    # called_op: the outermost op around the row, i.e. the call the Python code made. On a GPU
    # trace only kernel-launching ops are rows, so SDPA's math backend shows as bmm/_softmax rows
    # with no trace of aten::scaled_dot_product_attention; kprof suggest reads this to tell that
    # from hand-written attention.
    top = np.arange(len(op_parent))
    for _ in range(32):  # op nesting depth is < 10 in practice
        up = op_parent[top]
        if (up < 0).all():
            break
        top = np.where(up >= 0, up, top)
    rows["called_op"] = np.where(valid & is_op[hh], names[top[hh]], rows["op"])
    return rows[OP_COLUMNS].sort_values(["step", "ts (us)"], kind="stable").reset_index(drop=True)


def _empty_ops() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in OP_COLUMNS})


def _cpu_rows(events: TraceEvents) -> pd.DataFrame:
    h = events.host
    ops = h[h["is_op"]]
    step = _step_of(ops["start_ns"].to_numpy(), events.steps)
    keep = step >= 0
    ops = ops[keep]
    return pd.DataFrame({
        "host_row": ops.index.to_numpy(),
        "row_id": ops.index.to_numpy(),
        "step": step[keep],
        "op": ops["name"].astype(str).to_numpy(),
        "device_time (us)": ops["self_ns"].to_numpy() / 1e3,
        "n_kernels": 0,
        "kernel": "",
        "ts (us)": ops["ts (us)"].to_numpy(),
        "dur (us)": ops["dur (us)"].to_numpy(),
    })


def row_key(owner: np.ndarray, device_row: np.ndarray, is_op: np.ndarray) -> np.ndarray:
    """The op-table row of each device activity (`row_id`): the owning op's host row when an op
    launched it, else -1 - its row in events.device (one op-table row per such kernel)."""
    owner = np.asarray(owner, np.int64)
    by_op = (owner >= 0) & is_op[np.clip(owner, 0, None)] if len(is_op) else np.zeros(len(owner), bool)
    return np.where(by_op, owner, -1 - np.asarray(device_row, np.int64))


def _owners(events: TraceEvents) -> np.ndarray:
    """Per device activity: the innermost op enclosing its launch, the launch row itself when no
    op encloses it, or -1 without a launch event."""
    launch = events.device["launch"].to_numpy().astype(np.int64)
    host = events.host
    if not len(host):
        return np.full(len(launch), -1, np.int64)
    op_parent = host["op_parent"].to_numpy()
    is_op = host["is_op"].to_numpy()
    hl = np.clip(launch, 0, None)
    return np.where(launch < 0, -1, np.where(is_op[hl], hl, np.where(op_parent[hl] >= 0, op_parent[hl], hl)))


def _gpu_rows(events: TraceEvents, names: np.ndarray) -> pd.DataFrame:
    """Group device activity by the op (innermost op enclosing the launch) or, without one, by the
    launch event itself."""
    d = events.device.copy()
    host = events.host
    is_op = host["is_op"].to_numpy()
    # The runtime event's innermost enclosing op; if the launch row is itself an op (External id
    # fallback) use it; if it has no op, keep the launch row for its module/phase context.
    d["owner"] = _owners(events)
    d["device_row"] = np.arange(len(d))
    d["step"] = _device_steps(events)
    d = d[d["step"] >= 0]
    if d.empty:
        return pd.DataFrame()
    d["dur (us)"] = d["dur (us)"].astype(float)
    # Rows keyed by op: one per op execution. Rows without an op: one per kernel, keyed by its
    # row in events.device (so kernel_rows can name the op row of every kernel: see row_key).
    d["key"] = row_key(d["owner"].to_numpy(), d["device_row"].to_numpy(), is_op)
    d = d.sort_values("dur (us)", ascending=False, kind="stable")
    g = d.groupby("key", sort=False).agg(
        row_id=("key", "first"), host_row=("owner", "first"), step=("step", "first"), kernel=("name", "first"),
        device_time=("dur (us)", "sum"), n_kernels=("name", "size"), ts=("ts (us)", "min"),
        dur=("dur (us)", "sum"))
    g = g.reset_index(drop=True).rename(columns={"device_time": "device_time (us)", "ts": "ts (us)", "dur": "dur (us)"})
    hr = g["host_row"].to_numpy()
    g["op"] = np.where(hr >= 0, names[np.clip(hr, 0, None)], g["kernel"])
    g["op"] = np.where((hr >= 0) & is_op[np.clip(hr, 0, None)], g["op"], g["kernel"])
    return g


# Kineto's launch arguments on a kernel event (libkineto's ChromeTraceLogger, CUPTI's kernel
# activity record): grid and block as [x, y, z]; "blocks per SM" = grid blocks / SM count;
# "est. achieved occupancy %" from CUDA's occupancy calculator. Memcpy/memset events have none.
KERNEL_ARGS = {"grid": "grid", "block": "block", "registers per thread": "registers",
               "shared memory": "shared memory (B)", "blocks per SM": "blocks per SM",
               "warps per SM": "warps per SM", "est. achieved occupancy %": "est. occupancy %"}

KERNEL_COLUMNS = ["step", "row_id", "module", "module_class", "phase", "op", "kernel", "cat", "stream",
                  "ts (us)", "dur (us)", "grid", "block", "blocks", "threads per block", "registers",
                  "shared memory (B)", "blocks per SM", "warps per SM", "est. occupancy %"]


def kernel_rows(events: TraceEvents) -> pd.DataFrame:
    """Every kernel, memcpy and memset of the recorded steps as its own row, with the op-table row
    it belongs to (`row_id`, see row_key), its module, phase and op (as op_table names them), its
    own time and Kineto's launch arguments (grid, block, registers, shared memory, blocks and warps
    per SM, estimated occupancy; NaN or [] where the trace has none). Empty on a CPU-only trace."""
    d = events.device
    host = events.host
    if events.device_type != "cuda" or d.empty or events.steps.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in KERNEL_COLUMNS})
    names = host["name"].astype(str).to_numpy()
    is_op = host["is_op"].to_numpy()
    module, module_class, phase, _ = _host_context(events, names)
    owner = _owners(events)
    step = _device_steps(events)
    rid = row_key(owner, np.arange(len(d)), is_op)
    valid = owner >= 0
    oo = np.clip(owner, 0, None)
    kname = d["name"].astype(str).to_numpy()
    out = pd.DataFrame({
        "step": step, "row_id": rid,
        "module": np.where(valid, module[oo], UNATTRIBUTED),
        "module_class": np.where(valid, module_class[oo], ""),
        "phase": np.where(valid, phase[oo], "other"),
        "op": np.where(valid & is_op[oo], names[oo], kname),
        "kernel": kname, "cat": d["cat"].astype(str).to_numpy(), "stream": d["stream"].to_numpy(),
        "ts (us)": d["ts (us)"].to_numpy(float), "dur (us)": d["dur (us)"].to_numpy(float),
    })
    args = d["args"] if "args" in d else pd.Series([{}] * len(d))
    for key, col in KERNEL_ARGS.items():
        v = _arg(args, key)
        if col in ("grid", "block"):
            out[col] = [list(x) if isinstance(x, (list, tuple)) and len(x) == 3 else [] for x in v]
        else:
            out[col] = pd.to_numeric(v, errors="coerce").to_numpy(dtype=float)
    out["blocks"] = [float(np.prod(g)) if g else np.nan for g in out["grid"]]
    out["threads per block"] = [float(np.prod(b)) if b else np.nan for b in out["block"]]
    out = out[out["step"] >= 0]
    return out[KERNEL_COLUMNS].sort_values(["step", "ts (us)"], kind="stable").reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Input pipeline: data-loader fetches and host-to-device copies (read by analysis.input_wait_by_step)

# torch.utils.data wraps every batch fetch in record_function("enumerate(DataLoader)#<Iterator>.__next__")
# (torch/utils/data/dataloader.py, _BaseDataLoaderIter.__next__); <Iterator> is
# _SingleProcessDataLoaderIter for num_workers=0, _MultiProcessingDataLoaderIter otherwise.
DATA_LOADER_RE = re.compile(r"^enumerate\(DataLoader\)#(\w+)\.__next__$")
# CUPTI's memcpy kinds as Kineto names them: "Memcpy HtoD (Pageable -> Device)", "(Pinned -> Device)".
H2D_PREFIX = "Memcpy HtoD"


def input_ranges(events: TraceEvents) -> pd.DataFrame:
    """Host intervals of the input pipeline in the recorded steps, one row each: `kind` "loader"
    (a DataLoader batch fetch; `name` is the iterator class) or "h2d" (the host call that issued
    a host-to-device memcpy, e.g. cudaMemcpyAsync, which blocks the host for pageable memory;
    `name` is the memcpy's name, `device (us)` its duration on the device). Columns: step, kind,
    name, ts (us), dur (us), end (us), device (us)."""
    cols = ["step", "kind", "name", "ts (us)", "dur (us)", "end (us)", "device (us)"]
    parts = []
    h = events.host
    if len(h):
        it = h["name"].astype(str).str.extract(DATA_LOADER_RE)[0]
        lo = h[it.notna().to_numpy()]
        parts.append(pd.DataFrame({"step": _step_of(lo["start_ns"].to_numpy(), events.steps), "kind": "loader",
                                   "name": it[it.notna()].to_numpy(), "ts (us)": lo["ts (us)"].to_numpy(),
                                   "dur (us)": lo["dur (us)"].to_numpy(), "device (us)": np.nan}))
    d = events.device
    if len(d) and len(h):
        sel = d["name"].astype(str).str.startswith(H2D_PREFIX).to_numpy() & (d["launch"].to_numpy() >= 0)
        if sel.any():
            launch = d["launch"].to_numpy()[sel]
            parts.append(pd.DataFrame({"step": _device_steps(events)[sel], "kind": "h2d",
                                       "name": d["name"].to_numpy()[sel], "ts (us)": h["ts (us)"].to_numpy()[launch],
                                       "dur (us)": h["dur (us)"].to_numpy()[launch],
                                       "device (us)": d["dur (us)"].to_numpy()[sel]}))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols)
    if out.empty:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("kind", "name") else float) for c in cols})
    out["end (us)"] = out["ts (us)"] + out["dur (us)"]
    out = out[out["step"] >= 0]
    return out[cols].sort_values("ts (us)", kind="stable").reset_index(drop=True)

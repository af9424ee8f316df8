"""Inductor's kernels in the op table: attributed to modules and costed from the nodes they fuse.

Input: the op table (trace.op_table, costed by costmodel.annotate) and the kernel records the
runner kept at compile time (kprof/capture/compiled.py: one per kernel call site, with its graph,
fwd/bwd, kernel name, modules, aten ops, fused nodes and the tensors it reads and writes).

A kernel row is one whose op is an Inductor kernel name: `graph_<id>_cpp_fused_...` (a CPU
range; the id picks the graph) or `triton_{poi,red,per,tem,...}_...` (the range around a Triton
launch). Its records are those with that name, the row's phase (bwd rows: backward graphs) and,
when known, graph. The k-th time a step runs a kernel it takes the k-th record of that name,
when the step runs it as many times as it has records (the wrapper launches kernels in the
order Inductor generated them, e.g. the same `cpp_fused_gelu_view_1` for layers 0 and 1);
otherwise every record's modules together.

Each kernel row gets: `module` (the longest common prefix of its nodes' module paths, "" the
compiled root), `module_class` (that module's class when it is one of them), `fused_ops` (the
aten ops before decomposition, "aten::native_layer_norm,aten::gelu"), and a cost:
- FLOPs: the sum of the cost model's formulas over the fused post-grad nodes (0 for a node
  without one);
- bytes: the tensors the kernel reads from memory once plus those it writes once; intermediates
  stay in registers. Where Inductor recomputes a value in two kernels, both count it written
  (an upper bound on writes).
Extern kernels (matmuls, SDPA) are aten ops in the trace and already costed; they take the module
of their call site: the k-th `aten::mm` inside a graph's call is the graph's k-th `mm` record.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import numpy as np
import pandas as pd

from kprof.analyze import costmodel
from kprof.analyze.trace import OPTIMIZER, UNATTRIBUTED

# Inductor's kernel names: "cpp_fused_<ops>_<n>" (C++), "triton_<kind>_fused_<ops>_<n>" (Triton:
# poi pointwise, red reduction, per persistent reduction, tem template, ...), with the CPU range
# prefix "graph_<id>_" when cpp.enable_kernel_profile wrapped it.
KERNEL_RE = re.compile(r"^(?:graph_(?P<graph>\d+)_)?(?P<name>(?:cpp|triton)_\w+)$")


def kernel_name(op: str) -> tuple[int | None, str] | None:
    """(graph id or None, Inductor kernel name) for a kernel row's op; None for other ops."""
    m = KERNEL_RE.match(str(op))
    if not m:
        return None
    return (int(m["graph"]) if m["graph"] is not None else None), m["name"]


def extern_op(kernel: str) -> str:
    """The aten op an extern kernel call shows as in the trace: "extern_kernels.mm" -> "mm",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default" -> that op's name."""
    k = str(kernel)
    if "aten." in k:
        return k.split("aten.", 1)[1].split(".", 1)[0]
    return k.rsplit(".", 1)[-1]


def common_module(paths: list[str]) -> str:
    """The longest common dotted prefix: ['layers.0.mlp.up', 'layers.0.mlp.act'] -> 'layers.0.mlp'."""
    parts = [p.split(".") if p else [] for p in paths]
    if not parts:
        return ""
    out = []
    for seg in zip(*parts):
        if len(set(seg)) != 1:
            break
        out.append(seg[0])
    return ".".join(out)


def kernel_cost(rec: dict) -> tuple[float, float, bool]:
    """(FLOPs, bytes, bytes known) of one kernel record (see the module docstring)."""
    # Costed = its bytes are known: a fused kernel is memory traffic first; a node without a FLOP
    # formula (arange, cos in a rotary table) adds no FLOPs, as in the eager table's estimate.
    flops, known = 0.0, True
    for n in rec.get("nodes") or []:
        cost, _ = costmodel.inclusive_cost(n["op"], n["shapes"], n["dtypes"], n["strides"], n["concrete"], n["types"])
        if cost is not None:
            flops += cost.flops
    nbytes = 0.0
    for shape, dtype in list(rec.get("reads") or []) + list(rec.get("writes") or []):
        b = costmodel.obytes(shape, dtype)
        if b is None or not np.isfinite(b):
            known = False
        else:
            nbytes += float(b)
    return flops, nbytes, known


def _place(recs: list[dict]) -> tuple[str, str, str]:
    """(module, module_class, fused ops) of one or more records."""
    mods = [(p, c) for r in recs for p, c in r.get("modules") or []]
    path = common_module(sorted({p for p, _ in mods}))
    classes = {c for p, c in mods if p == path}
    aten = sorted({a for r in recs for a in r.get("aten") or []})
    return path, (classes.pop() if len(classes) == 1 else ""), ",".join(aten)


def attribute(ops: pd.DataFrame, kernels: list[dict] | None) -> pd.DataFrame:
    """The op table with Inductor kernel rows attributed and costed, and extern kernel calls
    inside compiled graphs attributed; adds `fused_ops` ("" on other rows) when there are
    kernel records. Pure."""
    if ops.empty or not kernels:  # nothing compiled: the table keeps its eager columns
        return ops
    ops = ops.copy()
    ops["fused_ops"] = ""
    by_name: dict[tuple[bool, str], list[dict]] = defaultdict(list)
    extern: dict[tuple[bool, str], list[dict]] = defaultdict(list)
    for r in kernels:
        if r.get("extern"):
            extern[(bool(r["backward"]), extern_op(r["kernel"]))].append(r)
        else:
            by_name[(bool(r["backward"]), r["kernel"])].append(r)

    parsed = ops["op"].map(kernel_name)
    is_kernel = parsed.notna().to_numpy()
    # Occurrence of each kernel (by name, phase and graph) within its step, in time order.
    keyed = ops.assign(_k=[f"{p}|{k[0]}|{k[1]}" if k is not None else "" for k, p in zip(parsed, ops["phase"])])
    occ = keyed.sort_values(["step", "ts (us)"], kind="stable").groupby(["step", "_k"]).cumcount()
    occ = occ.reindex(ops.index).to_numpy()
    runs = keyed.groupby(["step", "_k"])["op"].transform("size").to_numpy()
    cost_cache: dict[int, tuple[float, float, bool]] = {}
    module = ops["module"].to_numpy(dtype=object).copy()
    mclass = ops["module_class"].to_numpy(dtype=object).copy()
    fused = ops["fused_ops"].to_numpy(dtype=object).copy()
    flops = pd.to_numeric(ops["flops"], errors="coerce").to_numpy(float).copy()
    nbytes = pd.to_numeric(ops["bytes"], errors="coerce").to_numpy(float).copy()
    known = ops["cost_known"].to_numpy(bool).copy()
    phase = ops["phase"].to_numpy(dtype=object)
    for i in np.flatnonzero(is_kernel):
        graph, name = parsed.iat[i]
        recs = [r for r in by_name.get((phase[i] == "bwd", name), []) if graph is None or r["graph"] == graph]
        if not recs:
            continue
        n_run = int(runs[i])
        if n_run % len(recs) == 0:
            chosen = [recs[int(occ[i]) % len(recs)]]
        else:  # the step ran it another number of times: place it among all its call sites
            chosen = recs
        module[i], mclass[i], fused[i] = _place(chosen)
        r = chosen[0]
        if id(r) not in cost_cache:
            cost_cache[id(r)] = kernel_cost(r)
        f, b, ok = cost_cache[id(r)]
        flops[i], nbytes[i], known[i] = (f, b, True) if ok else (np.nan, np.nan, False)

    # Extern kernels: aten ops at the compiled root (no module range inside a compiled graph).
    if extern:
        ext_ops = ops["op"].astype(str).str.removeprefix("aten::")
        in_graph = ~is_kernel & ops["module"].isin(["", UNATTRIBUTED]) & (ops["module"] != OPTIMIZER)
        top = pd.to_numeric(ops["parent_id"], errors="coerce").fillna(-1).to_numpy() < 0
        sel = in_graph.to_numpy() & top & np.array([(p == "bwd", o) in extern for p, o in zip(phase, ext_ops)])
        sub = ops[sel].assign(_o=ext_ops[sel]).sort_values(["step", "ts (us)"], kind="stable")
        k_occ = sub.groupby(["step", "phase", "_o"]).cumcount()
        k_runs = sub.groupby(["step", "phase", "_o"])["op"].transform("size")
        for idx, o, ph in zip(sub.index, sub["_o"], sub["phase"]):
            recs = extern[(ph == "bwd", o)]
            if int(k_runs[idx]) % len(recs):
                continue  # eager ops of the same name outside the graphs: not placeable by order
            i = ops.index.get_loc(idx)
            module[i], mclass[i], fused[i] = _place([recs[int(k_occ[idx]) % len(recs)]])
    ops["module"], ops["module_class"], ops["fused_ops"] = module, mclass, fused
    ops["flops"], ops["bytes"], ops["cost_known"] = flops, nbytes, known
    return ops


def attributed_share(ops: pd.DataFrame) -> dict:
    """Device time of Inductor kernel rows, and the share of it attributed below the compiled
    root (a module path other than "") and costed. Keys: kernel_us, attributed, costed."""
    if ops.empty or "op" not in ops:
        return {"kernel_us": 0.0, "attributed": float("nan"), "costed": float("nan")}
    k = ops["op"].map(kernel_name).notna()
    t = pd.to_numeric(ops.loc[k, "device_time (us)"], errors="coerce").fillna(0.0)
    total = float(t.sum())
    if total <= 0:
        return {"kernel_us": 0.0, "attributed": float("nan"), "costed": float("nan")}
    attributed = ~ops.loc[k, "module"].isin(["", UNATTRIBUTED])
    return {"kernel_us": total, "attributed": float(t[attributed].sum() / total),
            "costed": float(t[ops.loc[k, "cost_known"].astype(bool)].sum() / total)}


# ----------------------------------------------------------------------------------------------
# Graph breaks and recompiles, from Dynamo's log messages (kprof/capture/compiled.py)

_KPROF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_KPROF_GUARDS = ("___check_torch_function_mode_stack", "User stack trace", "  File ")
_AT_RE = re.compile(r"in user code at (?P<file>.+?):(?P<line>\d+)\s*$", re.M)
_RECOMPILE_RE = re.compile(r"Recompiling function (?P<fn>\S+) in (?P<file>.+?):(?P<line>\d+)")
_GUARD_RE = re.compile(r"^\s*- (?P<id>\d+/\d+): (?P<guard>.+?)\s*$", re.M)
# A guard built from a line of user code ends "# <source>  # <file tail>:<line> in <fn>".
_GUARD_SRC_RE = re.compile(r"#\s*(?P<code>.+?)\s+#\s*\S*?:(?P<line>\d+) in \S+\s*$")


def _reason(msg: str) -> str:
    """The graph break's reason in one line: Dynamo's title after "Graph Break Reason:" (torch
    2.13 puts the generic "Encountered graph break when attempting to trace ..." first, the
    specific title after a blank line)."""
    lines = msg.split("\n")
    for i, ln in enumerate(lines):
        if ln.startswith("Graph Break Reason:"):
            rest = [x.strip() for x in lines[i + 1:] if x.strip()]
            first = ln.removeprefix("Graph Break Reason:").strip()
            if rest and not rest[0].startswith(("Explanation:", "Hint:", "Developer", "For more", "User code")):
                return rest[0]
            return first
    return lines[0].strip()


def _hints(msg: str) -> list[str]:
    return [ln.strip().removeprefix("Hint:").strip() for ln in msg.split("\n") if ln.strip().startswith("Hint:")]


def compile_events(messages: list[dict]) -> dict:
    """{"graph_breaks": [...], "recompiles": [...]}, one entry per distinct place, with counts.

    graph break: file, line, reason, hints, count (Dynamo logs a break once per compile of the
    frame: after a recompile the same break is logged again).
    recompile: function, file, line (the frame's first line), guard (the first failed guard),
    guard_line (the user's line the guard came from, when Dynamo gives it), count."""
    breaks: dict[tuple, dict] = {}
    recompiles: dict[tuple, dict] = {}
    for m in messages or []:
        msg = str(m.get("message", ""))
        if m.get("kind") == "graph_break":
            at = _AT_RE.search(msg.split("\n", 1)[0]) or _AT_RE.search(msg)
            if not at:
                continue
            if at["file"].startswith(_KPROF_DIR):
                # kprof's own host-sync detector wraps .item() & co.; Dynamo reports the same
                # break inside it as well as at the user's line (planted script, torch 2.13).
                continue
            key = (at["file"], int(at["line"]))
            e = breaks.setdefault(key, {"file": key[0], "line": key[1], "reason": _reason(msg),
                                        "hints": _hints(msg), "count": 0})
            e["count"] += 1
        elif m.get("kind") == "recompile":
            rc = _RECOMPILE_RE.search(msg)
            if not rc or rc["file"].startswith(_KPROF_DIR):
                # kprof's module hooks, which Dynamo compiles between graphs: not the script's.
                continue
            # kprof's host-sync detector is a TorchFunctionMode pushed for the watched steps, so
            # Dynamo's mode-stack guard fails when it comes and goes: kprof's doing, not the
            # script's (planted script, torch 2.13). The first other failed guard is the cause.
            guards = [g for _, g in _GUARD_RE.findall(msg) if not g.startswith(_KPROF_GUARDS)]
            if not guards:
                continue
            guard = guards[0]
            src = _GUARD_SRC_RE.search(guard)
            text = guard.split("#", 1)[0].strip() if src else guard
            key = (rc["file"], int(rc["line"]), rc["fn"], text)
            e = recompiles.setdefault(key, {"function": rc["fn"], "file": rc["file"], "line": int(rc["line"]),
                                            "guard": text, "guard_line": int(src["line"]) if src else None,
                                            "count": 0})
            e["count"] += 1
    return {"graph_breaks": list(breaks.values()), "recompiles": list(recompiles.values())}


def summary_section(ops: pd.DataFrame, kernels: list[dict] | None, messages: list[dict] | None) -> dict | None:
    """summary.json's "compile": kernel records, attribution shares, graph breaks, recompiles;
    None for a run that compiled nothing."""
    if not kernels and not messages:
        return None
    return {"kernel_records": len(kernels or []), "attribution": attributed_share(ops)} | compile_events(messages or [])

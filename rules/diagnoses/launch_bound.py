"""Launch-bound step: the GPU idles between many short kernels -> CUDA graphs / torch.compile(mode="reduce-overhead").

When kernels take less time on the device than the host needs to launch the next one, the GPU
runs ahead of the host and waits: the step's time is the host's launch rate, not the GPU's work
(on the H200 machine `x + 1` costs the host 12.2 us per call and a direct Triton launch 23.8 us,
benchmarks/results/host-overhead-h200-20261129.txt; `kprof calibrate` puts the latency threshold
at 14.1 us there, calibration-h200-20261129.json). A CUDA graph replays the whole step's
launches from one host call, so the gaps between kernels close; torch.compile(mode=
"reduce-overhead") records one for the compiled region (and also fuses kernels).

Evidence (GPU runs only):
- summary["idle_by_step"]: the device idle and busy time in each step's window (medians over
  steps). The profiler adds host time to every op, so profiled steps idle more than real ones:
  the idle used is the smaller of the profiled idle and the unprofiled step time
  (summary["step_time_ms"]) minus the busy time, which the profiler does not change;
- ops.parquet (`device_time (us)`, `n_kernels`): the kernels per step and how many of them are
  shorter than the run's calibrated launch latency summary["ceilings"]["latency_us"] (per launch:
  an op's device time / its kernels); without an op table, summary["class_breakdown"]'s
  latency-bound ops/step stand in (a share of ops, not of kernels);
- summary["input_wait_by_step"] (input_pipeline's evidence): the idle spent waiting for data,
  which a graph does not recover, is taken out.
It fires only when the rest of the idle is at least MIN_IDLE_SHARE of the step window and most
kernels are short: a step with long kernels and idle gaps is stalled by something else (host
syncs, Python work between launches), which host_sync and the other diagnoses point at.

Saving: that idle per step minus the data-wait idle (medians over steps): an upper bound.
Host syncs inside the step share that idle and break a graph (they must go first); graph
replay's own gaps between kernels are not subtracted.

The fix kprof installs (`cuda_graphs`, rules/cuda_graphs.py: the model's forward and backward
under torch.compile(mode="reduce-overhead")): a second diagnosis of that id, beside every
launch-bound finding, apply-able when nothing in the run blocks a graph (`graph_blockers`):
- a CUDA run, and not compiled already (Triton kernels in the step, or Dynamo's record);
- static shapes: the outermost module's tensor inputs had one shape over the recorded steps
  (summary["root_input_shapes"], recorded by the runner on every annotated step);
- no host sync inside the model's forward: a syncing op (`.item()`'s _local_scalar_dense,
  nonzero, ...) among the forward-phase ops, or a recorded sync site in a `forward` (a graph
  can't hold a sync: Dynamo breaks the graph there);
- no random op in the forward (dropout): Inductor draws its own random numbers, so the compiled
  forward can't be verified against eager's.
When something blocks, the launch_bound finding's advice says what, and the cuda_graphs row is
not apply-able (`kprof apply --patch cuda_graphs` then says why).

CPU runs: no finding. Ops run synchronously on the host, there is no device to idle and CUDA
graphs don't apply; an op's dispatch overhead is already part of its own time (the report's
latency-bound class). Flagging "many tiny ops" there would flag every small model on a CPU: the
clean planted script tests/diagnoses_scripts/adamw_fused.py, profiled on a 2-core CPU, runs 139
ops/step, 98% of them under the CPU's 20 us default latency threshold (median 1.2 us).
"""

from __future__ import annotations

import ast
import math

import numpy as np
import pandas as pd

from kprof.analyze.modules import median_of, op_base
from kprof.rules.cuda_graphs import ID as GRAPHS_ID
from kprof.rules.cuda_graphs import RULE as GRAPHS_RULE
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, parse_script
from kprof.rules.diagnoses.unfused_optimizer import construction_line
from kprof.rules.edits import no_diff

# The idle left after data waits must be at least 10% of the step window. Reference for a
# healthy step: the H200 Llama-1B run (benchmarks/results/summary-20261129-190658-llama_train.json)
# idles 1.9-2.0% of its steady steps (10% and 21% in the two steps that print the loss).
MIN_IDLE_SHARE = 0.10
# At least half the kernels must be shorter than the launch latency; that run has 208 of its
# 984 ops/step (21%) in the latency-bound class.
MIN_SHORT_SHARE = 0.5
# "high" confidence: the GPU idles most of the step and nearly every kernel is short.
HIGH_IDLE_SHARE, HIGH_SHORT_SHARE = 0.5, 0.8


# Forward-phase ops (op_base names) that make the host wait (a graph can't hold them), and the
# random ones whose compiled draws differ from eager's.
# (repeat_interleave syncs only without output_size=: the recorded sync sites tell.)
SYNC_OPS = frozenset({"local_scalar_dense", "nonzero", "masked_select", "unique", "unique2", "unique_dim",
                      "unique_consecutive"})
RANDOM_OPS = frozenset({"dropout", "native_dropout", "fused_dropout", "bernoulli", "bernoulli_", "rand", "rand_like",
                        "randn", "randn_like", "randint", "randint_like", "randperm", "multinomial", "normal",
                        "normal_", "uniform_", "exponential_"})


def _forward_ops(ops: pd.DataFrame, names: frozenset) -> list[str]:
    """The op_base names among `names` that ran in the forward phase."""
    if ops is None or not len(ops) or not {"phase", "op"} <= set(ops.columns):
        return []
    fwd = op_base(ops.loc[ops["phase"] == "fwd", "op"])
    return sorted(set(fwd[fwd.isin(names)]))


def _forward_lines(file: str) -> list[tuple[int, int]]:
    """(first, last) line of every `def forward` in `file` (ast; nothing is run)."""
    parsed = parse_script(file)
    if parsed is None:
        return []
    return [(n.lineno, n.end_lineno or n.lineno) for n in ast.walk(parsed[1])
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "forward"]


def forward_syncs(ops: pd.DataFrame, summary: dict) -> list[str]:
    """Host syncs inside the model's forward: the syncing ops among the forward-phase ops, and
    the recorded sync sites in a `forward` (its own function, or a line within one)."""
    out = _forward_ops(ops, SYNC_OPS)
    spans: dict[str, list[tuple[int, int]]] = {}
    for s in summary.get("syncs") or []:
        if not int(s.get("count") or 0):
            continue
        file, line = str(s.get("file") or ""), int(s.get("line") or 0)
        if file not in spans:
            spans[file] = _forward_lines(file)
        if s.get("function") == "forward" or any(a <= line <= b for a, b in spans[file]):
            out.append(f"{file.rsplit('/', 1)[-1]}:{line} {s.get('kind')} (`{s.get('code') or ''}`)")
    return out


def graph_blockers(ops: pd.DataFrame, summary: dict, compiled: bool = False) -> list[str]:
    """Why the cuda_graphs patch can't be installed on this run's step (module docstring); []
    when nothing blocks it. `compiled`: the step ran Triton kernels (kernel_stats)."""
    out = []
    if not is_gpu_run(summary):
        out.append("not a CUDA run: CUDA graphs record GPU kernels")
    if compiled or summary.get("compile"):
        out.append('the model is already compiled: set mode="reduce-overhead" on its torch.compile instead')
    shapes = summary.get("root_input_shapes")
    if shapes is None:
        out.append("the run has no record of the model's input shapes (profiled by an older kprof): profile again")
    elif len(shapes) > 1:
        seen = "; ".join(str(r.get("shapes")) for r in shapes[:3])
        out.append(f"the model's input shapes vary over the recorded steps ({len(shapes)} different: {seen}): a "
                   "graph replays one shape, each new one is compiled and recorded again; pad to fixed shapes")
    syncs = forward_syncs(ops, summary)
    if syncs:
        out.append(f"host syncs inside the model's forward ({', '.join(syncs[:3])}): a graph can't hold them")
    rnd = _forward_ops(ops, RANDOM_OPS)
    if rnd:
        out.append(f"random ops in the forward ({', '.join(rnd)}): the compiled forward draws other random "
                   "numbers than eager, so it can't be verified against it")
    return out


def kernel_stats(ops: pd.DataFrame, summary: dict, latency_us: float) -> dict | None:
    """Kernels per step, the share shorter than `latency_us` and their median duration (us), from
    the op table (kernel-weighted), or from the class breakdown (op-weighted) without one."""
    n = n_steps(ops, summary)
    if ops is not None and len(ops) and {"n_kernels", "device_time (us)"} <= set(ops.columns):
        k = pd.to_numeric(ops["n_kernels"], errors="coerce").fillna(0).to_numpy(float)
        t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0).to_numpy(float)
        has = k > 0
        if has.any():
            per = t[has] / k[has]
            order = np.argsort(per)
            cum = np.cumsum(k[has][order])
            median = float(per[order][np.searchsorted(cum, cum[-1] / 2)])
            names = ops.loc[has, "kernel"].astype(str) if "kernel" in ops else pd.Series(dtype=str)
            return {"source": "ops", "kernels per step": float(k[has].sum()) / n,
                    "short share": float(k[has][per < latency_us].sum() / k[has].sum()),
                    "median kernel us": median, "compiled": bool(names.str.startswith("triton_").any())}
    cb = {r.get("class"): float(r.get("ops/step") or 0) for r in summary.get("class_breakdown") or []}
    total = sum(v for c, v in cb.items() if c != "idle")
    if total <= 0:
        return None
    return {"source": "class_breakdown", "kernels per step": total, "short share": cb.get("latency-bound", 0.0) / total,
            "median kernel us": math.nan, "compiled": False}


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    if not is_gpu_run(summary):
        return []  # see the module docstring: no device to idle on a CPU run
    idle_rows = summary.get("idle_by_step") or []
    idle_us, window_us = median_of(idle_rows, "idle (us)"), median_of(idle_rows, "window (us)")
    ceil = summary.get("ceilings") or {}
    lat = float(ceil.get("latency_us") or math.nan)
    if not (math.isfinite(idle_us) and math.isfinite(window_us) and window_us > 0 and math.isfinite(lat)):
        return []
    # The profiler adds host time to every op, so a profiled step idles more than a real one; the
    # kernels take the same time either way, so the unprofiled step's idle is its time minus the
    # device busy time (when the runner timed unprofiled steps).
    busy_us = median_of(idle_rows, "busy (us)")
    plain_ms = float((summary.get("step_time_ms") or {}).get("median") or math.nan)
    if math.isfinite(plain_ms) and math.isfinite(busy_us) and plain_ms > 0:
        idle_us, window_us = min(idle_us, max(plain_ms * 1e3 - busy_us, 0.0)), min(window_us, plain_ms * 1e3)
        basis = "unprofiled step time - device busy time"
    else:
        basis = "profiled steps"
    wait_us = median_of(summary.get("input_wait_by_step") or [], "idle (us)")
    wait_us = min(wait_us, idle_us) if math.isfinite(wait_us) else 0.0
    rest_us = max(idle_us - wait_us, 0.0)
    ks = kernel_stats(ops, summary, lat)
    if ks is None or rest_us < MIN_IDLE_SHARE * window_us or ks["short share"] < MIN_SHORT_SHARE:
        return []

    syncs = sum(int(s.get("count") or 0) for s in summary.get("syncs") or [])
    per_launch_us = window_us / ks["kernels per step"] if ks["kernels per step"] else math.nan
    unit = "kernels" if ks["source"] == "ops" else "ops"
    lines = [f"GPU idle {idle_us / 1e3:.3f} ms/step ({idle_us / window_us:.0%} of the {window_us / 1e3:.3f} ms step, "
             f"median over steps; {basis})",
             f"{ks['kernels per step']:.0f} {unit}/step, {ks['short share']:.0%} shorter than the {lat:g} us launch "
             f"latency" + (f" (median kernel {ks['median kernel us']:.1f} us)" if math.isfinite(ks["median kernel us"]) else ""),
             f"one launch every {per_launch_us:.1f} us of step"
             + (": longer than the median kernel, so the host's launch rate sets the pace"
                if per_launch_us > ks["median kernel us"] else "")]
    if wait_us:
        lines.append(f"minus {wait_us / 1e3:.3f} ms/step of idle waiting for data (input_pipeline)")
    if syncs:
        lines.append(f"{syncs} host syncs in the recorded steps (host_sync): remove them first, a graph can't hold them")

    root = (summary.get("module_classes") or {}).get("")
    site = construction_line(summary.get("script"), root.rsplit(".", 1)[-1] if root else None)
    mode = 'torch.compile(model, mode="reduce-overhead")'
    if ks["compiled"]:
        how = f'already compiled (Triton kernels): compile with mode="reduce-overhead" to add CUDA graphs: {mode}'
    else:
        how = f"{mode} (CUDA graphs + fusion), or capture the step with torch.cuda.make_graphed_callables / torch.cuda.graph"
    if site:
        path, line = site[0].rsplit(":", 1)
        how = f"{path.rsplit('/', 1)[-1]}:{line} (the model, `{site[1]}`): {how}"
    blockers = graph_blockers(ops, summary, ks["compiled"])
    if blockers:
        how += f"; kprof apply can't install it ({GRAPHS_ID}): {'; '.join(blockers)}"
    else:
        how += f"; kprof apply --patch {GRAPHS_ID} installs it on this run, verified"
    note = (f"upper bound: GPU idle per step ({basis}) minus the idle waiting for data (medians); a CUDA graph "
            "replays the step's launches in one call, so at most this is recovered (graph replay's own gaps not subtracted)")
    if syncs:
        note += "; host syncs in the step share this idle"
    short, idle_share = ks["short share"], idle_us / window_us
    if ceil.get("kind") == "default":
        conf = "low"  # the latency threshold is a guess, not this GPU's
    elif idle_share >= HIGH_IDLE_SHARE and short >= HIGH_SHORT_SHARE and not syncs and ks["source"] == "ops":
        conf = "high"
    else:
        conf = "medium"
    return [Finding(
        where=f"whole step ({root})" if root else "whole step",
        evidence="\n".join(lines),
        change="capture the step in a CUDA graph (launch all its kernels in one call); static shapes, no host syncs",
        how=how,
        ms_per_step=idle_us / 1e3,
        saving_ms=rest_us / 1e3,
        saving_note=note,
        source=site[0] if site else "",
        paths=[site[0]] if site else [],
        cls="launch-bound",
        confidence=conf,
        details=[{"idle ms/step": idle_us / 1e3, "step ms": window_us / 1e3, "idle basis": basis,
                  "data wait ms/step": wait_us / 1e3, "latency us": lat, "host syncs": syncs,
                  "cuda_graphs blockers": blockers} | ks],
        diff=no_diff("which region to capture (the model, the loss, the whole step) and whether it is free of "
                     "host syncs and shape changes depend on the script: no exact textual change is derived"),
    )]


DIAGNOSIS = Diagnosis(id="launch_bound", title="launch-bound step (GPU idle between short kernels)", find=find)


def find_graphs(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    """The installable fix beside each launch-bound finding: apply-able when nothing blocks it."""
    out = []
    for f in find(ops, summary):
        blockers = f.details[0]["cuda_graphs blockers"]
        if blockers:
            how = f"not installable: {'; '.join(blockers)}"
        else:
            how = f"kprof apply --patch {GRAPHS_ID} (this run, verified at the first call before any capture)"
        out.append(Finding(
            where=f.where, evidence=f.evidence, change=f"{GRAPHS_ID}: {GRAPHS_RULE.change}", how=how,
            ms_per_step=f.ms_per_step, saving_ms=f.saving_ms, saving_note=f.saving_note, source=f.source,
            paths=list(f.paths), cls=f.cls, confidence=f.confidence, details=f.details,
            diff=no_diff("an installed patch on the live model (kprof apply / kprof.patch), no source change"),
            applyable=not blockers,
        ))
    return out


GRAPHS = Diagnosis(id=GRAPHS_ID, title="CUDA graphs for the launch-bound step (installable)", find=find_graphs)
DIAGNOSES = [DIAGNOSIS, GRAPHS]

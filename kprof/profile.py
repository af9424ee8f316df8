"""`kprof profile` as a library call: run the script, analyse the trace, save the run.

    from kprof.profile import profile_script, load_run
    run = profile_script("examples/gpt_train.py", [], warmup=3, steps=5)
    run.summary["step_time_ms"]["median"], run.ops.head()

The facade only wires the parts together: the runner (kprof/runner.py) runs the script and exports
the trace, the analysis (trace, costmodel, ceilings, analysis) turns it into DataFrames, the store
writes the run directory. Rendering is kprof/report.py's job.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable

import pandas as pd

import kprof
from kprof import store
from kprof.errors import KprofError
from kprof.store import Run

TOP_K = 15  # top ops kept in summary.json (the full table is in ops.parquet)

Progress = Callable[..., None]  # progress(event: str, **info); see kprof/runner.py


def profile_script(
    script: str,
    argv: list[str] | None = None,
    *,
    warmup: int = 3,
    steps: int = 5,
    run_to_end: bool = False,
    step_mode: str = "auto",
    out_root: str | os.PathLike = store.DEFAULT_ROOT,
    progress: Progress | None = None,
    on_root_module: Callable | None = None,
) -> Run:
    """Profile `script` and save the run under `out_root`; returns the saved Run.

    A script that raises or is interrupted after at least one recorded step still gets its
    (partial) run saved: check `run.summary["status"]` ("completed" | "stopped" | "error" |
    "interrupted"). If it fails before any step was recorded there is nothing to save and a
    KprofError carries the script's traceback.
    """
    if steps <= 0:
        raise KprofError(f"--steps must be at least 1 (got {steps})", exit_code=2)
    if warmup < 0:
        raise KprofError(f"--warmup can't be negative (got {warmup})", exit_code=2)
    if step_mode not in ("auto", "optimizer", "forward"):
        raise KprofError(f"--step must be auto, optimizer or forward (got {step_mode!r})", exit_code=2)
    notify = progress or (lambda event, **info: None)
    from kprof.runner import RunConfig, run_script

    with tempfile.TemporaryDirectory(prefix="kprof-trace-") as trace_dir:
        cfg = RunConfig(warmup=warmup, steps=steps, run_to_end=run_to_end, step_mode=step_mode,
                        trace_dir=trace_dir, on_root_module=on_root_module)
        raw = run_script(script, list(argv or []), cfg, progress=progress)

        if not raw.steps_recorded or not raw.trace_path:
            raise KprofError(_nothing_recorded(raw), exit_code=raw.exit_code or 1)

        notify("analysis")
        ops, analysed = analyse(raw)
        summary = build_summary(raw, analysed)
        notify("save")
        path = store.save_run(summary, ops, raw.trace_path, root=out_root)
    return Run(path=path, summary=store.load_summary(path), _ops=ops)


def load_run(path: str | os.PathLike | None = None, root: str | os.PathLike = store.DEFAULT_ROOT) -> Run:
    """A saved run by directory or name (the latest under `root` when None)."""
    return store.load_run(path, root)


def _nothing_recorded(raw) -> str:
    if raw.status == "error":
        return (f"{raw.script} raised before any step was recorded, so there is nothing to profile:\n"
                f"{(raw.error or '').rstrip()}")
    if raw.status == "interrupted":
        return "interrupted before any step was recorded; nothing was saved"
    return f"no step was recorded, so nothing was saved: {raw.message or raw.status}"


# --------------------------------------------------------------------------------------------
# Analysis wiring


def analyse(raw) -> tuple[pd.DataFrame, dict]:
    """The per-op table with costs and roofline columns, plus the summary's analysed sections."""
    from kprof import analysis, ceilings, costmodel, trace

    events = trace.load_trace(raw.trace_path)
    ops = trace.op_table(events)
    ops = costmodel.annotate(ops)
    ceil = ceilings.for_device(raw.device)
    ops = analysis.roofline(ops, ceil)
    n = raw.steps_recorded
    idle = analysis.idle_by_step(trace.kernel_table(events), trace.step_windows(events))
    out = {
        "ceilings": ceil,
        "class_breakdown": analysis.class_breakdown(ops, idle, n),
        "top_ops": analysis.top_ops(ops, n, TOP_K),
        "coverage": analysis.coverage(ops),
        "idle": idle,
    }
    return ops, out


def build_summary(raw, a: dict) -> dict[str, Any]:
    from dataclasses import asdict, is_dataclass

    from kprof import analysis

    dev = dict(raw.device or {})
    ceil = a["ceilings"]
    st = _stats(analysis, raw.step_times_ms)
    pst = _stats(analysis, raw.profiled_step_times_ms)
    tokens_per_s = None
    if raw.tokens_per_step and st and st.get("median"):
        tokens_per_s = raw.tokens_per_step / (st["median"] / 1e3)
    overhead = None
    if raw.step_times_ms and raw.profiled_step_times_ms:
        overhead = 100.0 * analysis.overhead(raw.profiled_step_times_ms, raw.step_times_ms)
    classes = _records(a["class_breakdown"])
    idle_row = next((r for r in classes if r.get("class") == "idle"), None)
    busy = None if idle_row is None or idle_row.get("% of step") is None else 100.0 - idle_row["% of step"]
    return {
        "format": store.FORMAT,
        "kprof_version": kprof.__version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "script": raw.script,
        "argv": list(raw.argv),
        "status": raw.status,
        "status_note": raw.message or "",
        "warnings": list(raw.warnings),
        "error": raw.error,
        "exit_code": raw.exit_code,
        "device": dev,
        "versions": {k: dev.get(k) for k in ("torch", "triton", "cuda", "python")} | {"kprof": kprof.__version__,
                                                                                      "platform": platform.platform()},
        "ceilings": asdict(ceil) if is_dataclass(ceil) else dict(ceil),
        "step_definition": raw.step_definition,
        "warmup": raw.warmup,
        "steps": raw.steps,
        "steps_recorded": raw.steps_recorded,
        "step_times_ms": list(raw.step_times_ms),
        "profiled_step_times_ms": list(raw.profiled_step_times_ms),
        "step_time_ms": st,
        "profiled_step_time_ms": pst,
        "profiler_overhead_pct": overhead,
        "tokens_per_step": raw.tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": raw.peak_memory_bytes,
        "peak_memory_kind": raw.peak_memory_label or "",
        "busy_pct": busy,
        "coverage_pct": 100.0 * a["coverage"] if a["coverage"] is not None else None,
        "class_breakdown": classes,
        "top_ops": _records(a["top_ops"]),
        "syncs": list(raw.syncs),
        "losses": list(raw.losses),
        "module_classes": dict(raw.module_classes),
        "wall_time_s": raw.wall_time_s,
    }


def _stats(analysis, times: list[float]) -> dict | None:
    if not times:
        return None
    s = analysis.step_stats(times)
    return dict(s) | {"n": len(times)}


def _records(df: pd.DataFrame | None) -> list[dict]:
    if df is None:
        return []
    unnamed_index = all(n is None for n in df.index.names)
    return store._jsonable(df.reset_index(drop=unnamed_index).to_dict(orient="records"))

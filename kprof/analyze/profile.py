"""`kprof profile` as a library call: run the script, analyse the trace, save the run.

    from kprof.analyze.profile import profile_script, load_run
    run = profile_script("examples/gpt_train.py", [], warmup=3, steps=5)
    run.summary["step_time_ms"]["median"], run.ops.head()

The facade only wires the parts together: the runner (kprof/capture/runner.py) runs the script and exports
the trace, the analysis (trace, costmodel, ceilings, analysis) turns it into DataFrames, the store
writes the run directory. Rendering is kprof/cli/render.py's job.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import tempfile
import traceback
from typing import Any, Callable

import pandas as pd

from kprof import store
from kprof.errors import BAD_INPUT, INTERRUPTED, SCRIPT_FAILED, KprofError
from kprof.store import Run
from kprof.version import __version__

TOP_K = 15  # top ops kept in summary.json (the full table is in ops.parquet)

Progress = Callable[..., None]  # progress(event: str, **info); see kprof/capture/runner.py


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
    shapes_every_step: bool = False,
    summary_extra: dict | None = None,
    detect_syncs: bool = True,
) -> Run:
    """Profile `script` and save the run under `out_root`; returns the saved Run.

    A script that raises or is interrupted after at least one recorded step still gets its
    (partial) run saved: check `run.summary["status"]` ("completed" | "stopped" | "error" |
    "interrupted"). If it fails before any step was recorded there is nothing to save and a
    KprofError carries the script's traceback.

    Op shapes are recorded on one step after the recorded ones; `shapes_every_step` records them
    on every recorded step instead (ops whose shapes vary from step to step: MoE dispatch, packed
    sequences), at the cost of profiler overhead on the timed ops. `summary_extra` is merged into
    summary.json (kprof apply marks its patched run with it, partial runs included).
    `detect_syncs` False runs without the host-sync detector (a torch function mode, see
    kprof.capture.runner.RunConfig): the run then reports no host syncs.
    """
    from kprof.capture.runner import RunConfig, run_script

    notify = progress or (lambda event, **info: None)
    extra = dict(summary_extra or {})
    store.ensure_root(out_root, exit_code=2)  # a bad --out fails now, not after the whole run

    with tempfile.TemporaryDirectory(prefix="kprof-trace-") as trace_dir:
        cfg = RunConfig(warmup=warmup, steps=steps, run_to_end=run_to_end, step_mode=step_mode,
                        trace_dir=trace_dir, on_root_module=on_root_module, shapes_every_step=shapes_every_step,
                        detect_syncs=detect_syncs)
        # Raises KprofError (exit code 2) for a missing script or bad --steps/--warmup/--step.
        raw = run_script(script, list(argv or []), cfg, progress=progress)

        if not raw.steps_recorded or not raw.trace_path:
            # A script that never stepped did not fail: kprof could not profile it (bad input).
            code = {"interrupted": INTERRUPTED, "error": SCRIPT_FAILED}.get(raw.status, BAD_INPUT)
            raise KprofError(_nothing_recorded(raw), exit_code=code,
                             detail=raw.error if raw.status == "error" else None)

        notify("analysis")
        try:
            ops, analysed = analyse(raw)
        except KeyboardInterrupt:
            # Ctrl-C (or SIGTERM) after the last recorded step: the steps are measured, so keep
            # them, with the raw trace, marked interrupted, rather than lose the whole run.
            summary = build_summary(raw, None) | extra | {
                "status": "interrupted",
                "status_note": f"interrupted during kprof's analysis; {raw.steps_recorded} recorded steps and the "
                               "raw trace are kept, without the op table: profile again for the analysis"}
            path = store.save_run(summary, pd.DataFrame(), raw.trace_path, root=out_root)
            raise KprofError(f"interrupted during kprof's analysis; the measurements and raw trace are saved in "
                             f"{path}, marked interrupted; profile again for the analysis",
                             exit_code=INTERRUPTED) from None
        except KprofError as e:
            # The trace itself is bad (truncated, not JSON): the user's environment, not a kprof bug.
            summary = build_summary(raw, None) | extra | {"analysis_error": str(e)}
            path = store.save_run(summary, pd.DataFrame(), None, root=out_root)
            raise KprofError(f"{e} (the run's measurements are saved in {path})", exit_code=e.exit_code) from None
        except Exception:
            # A bug in kprof's analysis must not cost the user the run: keep what the runner
            # measured and the raw trace, then fail loudly.
            tb = traceback.format_exc()
            summary = build_summary(raw, None) | extra | {"analysis_error": tb}
            path = store.save_run(summary, pd.DataFrame(), raw.trace_path, root=out_root)
            raise KprofError(f"kprof's trace analysis failed; this is a kprof bug, please report it with the "
                             f"trace. The run's measurements and raw trace are saved in {path}",
                             exit_code=SCRIPT_FAILED, detail=tb) from None
        summary = build_summary(raw, analysed) | extra
        notify("save")
        path = store.save_run(summary, ops, raw.trace_path, root=out_root)
    return Run(path=path, summary=store.load_summary(path), _ops=ops)


def load_run(path: str | os.PathLike | None = None, root: str | os.PathLike = store.DEFAULT_ROOT) -> Run:
    """A saved run by directory or name (the latest under `root` when None)."""
    return store.load_run(path, root)


def _nothing_recorded(raw) -> str:
    name = os.path.basename(raw.script)
    if raw.status == "error":
        why = (raw.error or "").strip().splitlines()[-1:] or ["?"]
        return (f"{name} failed (exit code {raw.exit_code}) before any step was recorded, so nothing was saved: "
                f"{why[0]}; fix the script (its traceback is above) and profile again")
    if raw.status == "interrupted":
        return "interrupted before any step was recorded; nothing was saved"
    return f"no step was recorded, so nothing was saved: {raw.message or raw.status}"


# --------------------------------------------------------------------------------------------
# Analysis wiring


def analyse(raw) -> tuple[pd.DataFrame, dict]:
    """The per-op table with costs and roofline columns, plus the summary's analysed sections."""
    from kprof.analyze import ceilings, costmodel, trace
    from kprof.analyze import tables as analysis

    events = trace.load_trace(raw.trace_path)
    if events.device_type == "cpu" and (raw.device or {}).get("type") == "cuda":
        # A GPU machine, but the script launched nothing on it (H200 run, 2026-11-29: a CPU script's
        # host idle time was read as GPU idle). Describe and judge it as the CPU run it was.
        from kprof.capture.runner import device_info

        raw.device = device_info(use_cuda=False) | {"unused_gpu": (raw.device or {}).get("name")}
        raw.syncs = list(raw.syncs_cpu)  # what would sync on a GPU, like any CPU run
    ops = costmodel.annotate(trace.op_table(events))
    ceil = ceilings.for_device(raw.device)
    # The runner doesn't record whether TF32 was allowed for fp32 matmuls; the roofline assumes
    # PyTorch's default (off), so fp32 matmuls are held to the fp32 peak.
    ops = analysis.roofline(ops, ceil, tf32=False)
    n = raw.steps_recorded
    idle = analysis.idle_by_step(trace.kernel_table(events), trace.step_windows(events))
    # Every % of step, busy and idle figure is on the unprofiled step (tables.step_basis).
    plain_ms = analysis.step_stats(raw.step_times_ms)["median"] if raw.step_times_ms else None
    out = {
        "ceilings": ceil,
        "idle": idle,
        "basis": analysis.idle_basis(idle, plain_ms),
        "class_breakdown": analysis.class_breakdown(ops, idle, n, plain_ms),
        "top_ops": analysis.top_ops(ops, n, TOP_K, ceilings=ceil, idle=idle, plain_ms=plain_ms),
        "coverage": analysis.coverage(ops),
        "estimated": analysis.estimated_share(ops),
        "uncosted": analysis.uncosted(ops, n),
        "step_time_ms": _stats(analysis, raw.step_times_ms),
        "profiled_step_time_ms": _stats(analysis, raw.profiled_step_times_ms),
        "overhead": analysis.overhead(raw.profiled_step_times_ms, raw.step_times_ms),
        # DataLoader fetches and host-to-device copies per step, with the GPU idle inside them (all
        # device activity counts as busy, also the previous step's tail that belongs to no step).
        "input_wait": analysis.input_wait_by_step(
            trace.input_ranges(events), events.device if events.device_type == "cuda" else None,
            events.steps["step"].tolist()),
    }
    return ops, out


def build_summary(raw, a: dict | None) -> dict[str, Any]:
    """summary.json: the raw run's facts plus the analysed sections (fields: see README).
    `a` is None when the analysis failed: the analysed sections are then empty."""
    from dataclasses import asdict

    a = a or {"step_time_ms": None, "profiled_step_time_ms": None, "overhead": None, "idle": None,
              "ceilings": None, "coverage": None, "class_breakdown": None, "top_ops": None}
    dev = dict(raw.device or {})
    st = a["step_time_ms"]
    tokens_per_s = None
    if raw.tokens_per_step and st and st.get("median"):
        tokens_per_s = raw.tokens_per_step / (st["median"] / 1e3)
    idle = a["idle"]
    # Busy share of the unprofiled step (tables.step_basis): on a GPU the time some kernel ran,
    # on a CPU the time some op ran, measured in the recorded steps.
    basis = a.get("basis") or {}
    busy = basis.get("busy %")
    busy = busy if busy is not None and math.isfinite(busy) else None
    overhead_pct = None if a["overhead"] is None else 100.0 * a["overhead"]
    return {
        "format": store.FORMAT,
        "kprof_version": __version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "script": raw.script,
        "argv": list(raw.argv),
        "status": raw.status,
        "status_note": raw.message or "",
        "warnings": list(raw.warnings) + _timing_warnings(raw),
        "error": raw.error,
        "exit_code": raw.exit_code,
        "device": dev,
        "versions": {k: dev.get(k) for k in ("torch", "triton", "cuda", "python")}
                    | {"kprof": __version__, "platform": platform.platform()},
        "ceilings": asdict(a["ceilings"]) if a["ceilings"] is not None else None,
        "tf32_assumed": False,
        "step_definition": raw.step_definition,
        "warmup": raw.warmup,
        "steps_before_timing": raw.steps_before_timing,  # > warmup when auto step mode decided late
        "profiler_warmup_steps": raw.profiler_warmup_steps,
        "steps": raw.steps,
        "steps_recorded": raw.steps_recorded,
        "step_times_ms": list(raw.step_times_ms),
        "profiled_step_times_ms": list(raw.profiled_step_times_ms),
        "step_time_ms": st,
        "profiled_step_time_ms": a["profiled_step_time_ms"],
        "profiler_overhead_pct": overhead_pct,
        "figure_basis": _figure_basis(basis, overhead_pct, raw),
        "tokens_per_step": raw.tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "peak_memory_bytes": raw.peak_memory_bytes,
        "peak_memory_kind": raw.peak_memory_label or "",
        "busy_pct": busy,
        "coverage_pct": None if a["coverage"] is None else 100.0 * a["coverage"],
        "estimated_pct": None if a.get("estimated") is None else 100.0 * a["estimated"],
        "uncosted_ops": _records(a.get("uncosted")),
        "class_breakdown": _records(a["class_breakdown"]),
        "top_ops": _records(a["top_ops"]),
        "idle_by_step": _records(idle),
        "input_wait_by_step": _records(a.get("input_wait")),
        "syncs": list(raw.syncs),
        "sync_steps": getattr(raw, "sync_steps", 0),  # steps the sync detector watched
        "losses": list(raw.losses),
        "module_classes": dict(raw.module_classes),
        "wall_time_s": raw.wall_time_s,
    }


def _timing_warnings(raw) -> list[str]:
    from kprof.analyze import tables

    return tables.timing_warnings(raw.step_times_ms, raw.profiled_step_times_ms)


def _figure_basis(basis: dict, overhead_pct: float | None, raw) -> dict:
    """The one statement of what the figures are measured on (summary["figure_basis"])."""
    step_us = basis.get("step (us)")
    shapes = getattr(raw, "shapes_recorded", "shapes step")
    slower = f"{overhead_pct:+.0f}%" if overhead_pct is not None else "an unknown amount"
    return {
        "step": basis.get("basis") or "none",
        "step ms": step_us / 1e3 if step_us is not None and math.isfinite(step_us) else None,
        "op times": "profiled steps",
        "shapes": shapes,
        "note": (f"% of step, busy, idle and savings are of the {basis.get('basis') or 'unknown'} (median); "
                 f"per-op times come from the profiled steps, which ran {slower} vs unprofiled "
                 f"(device kernels take the same time; host-side times include the profiler's). "
                 + ("Op shapes come from the profiler warm-up step." if shapes == "shapes step"
                    else "Op shapes were recorded on every step.")),
    }


def _stats(analysis, times: list[float]) -> dict | None:
    return analysis.step_stats(times) | {"n": len(times)} if times else None


def _records(df: pd.DataFrame | None) -> list[dict]:
    if df is None:
        return []
    unnamed_index = all(n is None for n in df.index.names)
    return store.jsonable(df.reset_index(drop=unnamed_index).to_dict(orient="records"))

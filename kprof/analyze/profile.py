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
import re
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from kprof import store
from kprof.errors import BAD_INPUT, INTERRUPTED, SCRIPT_FAILED, KprofError
from kprof.store import Run
from kprof.version import __version__

TOP_K = 15  # top ops kept in summary.json (the full table is in ops.parquet)
TOP_KERNELS = 20  # top kernels kept in summary.json (every kernel is in kernels.parquet)

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
    nproc_per_node: int | None = None,
    on_optimizer: Callable | None = None,
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
    sequences), at the cost of profiler overhead on the timed ops.

    `nproc_per_node`: run the script under torchrun with that many processes, each rank
    profiling itself; returns the merged run (rank 0's tables at the top, every rank's run
    under ranks/, summary["distributed"] with the per-rank view). Run under the user's own
    torchrun (RANK and WORLD_SIZE set), the same happens without it.

    `summary_extra` is merged into summary.json (kprof apply marks its patched run with it,
    partial runs included).
    `detect_syncs` False runs without the host-sync detector (a torch function mode, see
    kprof.capture.runner.RunConfig): the run then reports no host syncs.
    """
    from kprof.capture.runner import RunConfig, run_script

    if nproc_per_node is not None:
        return _profile_job(script, list(argv or []), nproc_per_node, warmup=warmup, steps=steps,
                            run_to_end=run_to_end, step_mode=step_mode, out_root=out_root)

    notify = progress or (lambda event, **info: None)
    extra = dict(summary_extra or {})
    store.ensure_root(out_root, exit_code=2)  # a bad --out fails now, not after the whole run

    with tempfile.TemporaryDirectory(prefix="kprof-trace-") as trace_dir:
        cfg = RunConfig(warmup=warmup, steps=steps, run_to_end=run_to_end, step_mode=step_mode,
                        trace_dir=trace_dir, on_root_module=on_root_module, shapes_every_step=shapes_every_step,
                        on_optimizer=on_optimizer, detect_syncs=detect_syncs)
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
        summary = build_summary(raw, analysed) | {"memory": _memory(raw)} | extra
        notify("save")
        rank = rank_env()
        if rank is not None:
            return _save_rank(summary, ops, raw, rank, out_root, analysed.get("kernels"))
        path = store.save_run(summary, ops, raw.trace_path, root=out_root, memory=raw.memory,
                              memory_snapshot=raw.memory_snapshot_path, kernels=analysed.get("kernels"))
    return Run(path=path, summary=store.load_summary(path), _ops=ops)


# --------------------------------------------------------------------------------------------
# Multi-process jobs (torchrun): every rank profiles itself, rank 0 merges

RANK_WAIT_S = 300.0  # rank 0 waits this long for the other ranks' runs (their analysis may lag)


def rank_env() -> dict | None:
    """{"rank", "world_size", "group"} when this process is one rank of a torchrun job of more
    than one process, else None. `group` is the same on every rank of one launch: kprof's own
    (KPROF_GROUP, from --nproc-per-node) or torchrun's run id and rendezvous address."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    if world <= 1:
        return None
    group = os.environ.get("KPROF_GROUP") or "-".join(
        os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    return {"rank": rank, "world_size": world, "group": re.sub(r"[^A-Za-z0-9_.-]+", "_", group) or "job"}


def _profile_job(script: str, argv: list[str], nproc: int, *, warmup: int, steps: int, run_to_end: bool,
                 step_mode: str, out_root) -> Run:
    from kprof.capture import launch

    if not os.path.isfile(script):
        raise KprofError(f"script {script} not found; pass the path of your training script", exit_code=2)
    store.ensure_root(out_root, exit_code=2)
    group = launch.new_group()
    args = ["--warmup", str(warmup), "--steps", str(steps), "--step", step_mode, "--out", str(out_root)]
    rc = launch.launch(script, argv, nproc, args + (["--run-to-end"] if run_to_end else []), group)
    for p in reversed(store.list_runs(out_root)):
        try:
            s = store.load_summary(p)
        except KprofError:
            continue
        if (s.get("distributed") or {}).get("group") == group:
            return Run(path=p, summary=s)
    code = 130 if rc == 130 else (rc or 1)
    raise KprofError(f"the {nproc}-process job saved no merged run (torchrun exit code {rc}); the ranks' "
                     f"output above says why, and runs a rank saved are under {out_root}/.ranks-{group}",
                     exit_code=code)


def _save_rank(summary: dict, ops: pd.DataFrame, raw, env: dict, out_root, kernel_rows=None) -> Run:
    """Save this rank's run under <out>/.ranks-<group>/rank<N> (hidden: not a run of its own);
    rank 0 then waits for the others and saves the merged run (store.save_group)."""
    import shutil
    import time

    from kprof.analyze import distributed

    rank, world = env["rank"], env["world_size"]
    summary = summary | {"rank": rank, "world_size": world, "group": env["group"]}
    staging = Path(out_root) / f".ranks-{env['group']}"
    mine = staging / f"rank{rank}"
    if mine.exists():  # left by an earlier launch that reused the rendezvous address
        shutil.rmtree(mine, ignore_errors=True)
    path = store.save_run(summary, ops, raw.trace_path, root=staging, name=f"rank{rank}", memory=raw.memory,
                          memory_snapshot=raw.memory_snapshot_path, kernels=kernel_rows)
    if rank != 0:
        return Run(path=path, summary=summary, _ops=ops)

    wait_s = float(os.environ.get("KPROF_RANK_WAIT_S", RANK_WAIT_S))
    deadline = time.monotonic() + wait_s
    want = [staging / f"rank{r}" for r in range(world)]
    while not all((d / store.SUMMARY).exists() for d in want) and time.monotonic() < deadline:
        time.sleep(0.2)
    found = [d for d in want if (d / store.SUMMARY).exists()]
    merged = distributed.merge_ranks([store.load_summary(d) for d in found], world)
    merged["group"] = env["group"]
    top = summary | {"distributed": merged}
    if merged["missing_ranks"]:
        top["warnings"] = list(top.get("warnings") or []) + [
            f"rank(s) {', '.join(map(str, merged['missing_ranks']))} saved no run within {wait_s:.0f} s "
            f"(failed, or still analysing: a late one is kept in {staging})"]
    final = store.save_group(top, lead=path, ranks=found, root=out_root)
    try:
        staging.rmdir()  # only if empty: a late rank's run stays
    except OSError:
        pass
    return Run(path=final, summary=store.load_summary(final), _ops=ops)


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
    from kprof.analyze import ceilings, compiled, costmodel, distributed, efficiency, kernels, trace
    from kprof.analyze import tables as analysis

    events = trace.load_trace(raw.trace_path)
    if events.device_type == "cpu" and (raw.device or {}).get("type") == "cuda":
        # A GPU machine, but the script launched nothing on it (H200 run, 2026-11-29: a CPU script's
        # host idle time was read as GPU idle). Describe and judge it as the CPU run it was.
        from kprof.capture.runner import device_info

        raw.device = device_info(use_cuda=False) | {"unused_gpu": (raw.device or {}).get("name")}
        raw.syncs = list(raw.syncs_cpu)  # what would sync on a GPU, like any CPU run
    ops = costmodel.annotate(trace.op_table(events))
    ops = compiled.attribute(ops, getattr(raw, "inductor_kernels", None))
    ceil = ceilings.for_device(raw.device)
    # The runner doesn't record whether TF32 was allowed for fp32 matmuls; the roofline assumes
    # PyTorch's default (off), so fp32 matmuls are held to the fp32 peak.
    ops = analysis.roofline(ops, ceil, tf32=False)
    gpu = events.device_type == "cuda"
    sm_count = (raw.device or {}).get("sm_count")
    # Every kernel its own row (kernels.parquet); the ops take their kernels' grid causes.
    ktab = kernels.kernel_table(events, ops, ceil, sm_count) if gpu else None
    extra = kernels.op_grid_causes(ktab)
    ops = efficiency.qualify(ops, gpu=gpu, sm_count=sm_count,
                             extra_causes=ops["row_id"].map(extra) if len(extra) and "row_id" in ops else None)
    n = raw.steps_recorded
    busy = trace.kernel_table(events)
    idle = analysis.idle_by_step(busy, trace.step_windows(events))
    # Every % of step, busy and idle figure is on the unprofiled step (tables.step_basis).
    plain_ms = analysis.step_stats(raw.step_times_ms)["median"] if raw.step_times_ms else None
    out = {
        "ceilings": ceil,
        "idle": idle,
        "basis": analysis.idle_basis(idle, plain_ms),
        "class_breakdown": analysis.class_breakdown(ops, idle, n, plain_ms),
        "top_ops": analysis.top_ops(ops, n, TOP_K, ceilings=ceil, idle=idle, plain_ms=plain_ms),
        "kernels": ktab,
        "top_kernels": kernels.top_kernels(ktab, n, TOP_KERNELS,
                                           analysis.idle_basis(idle, plain_ms)["step (us)"]) if gpu else None,
        "coverage": analysis.coverage(ops),
        "estimated": analysis.estimated_share(ops),
        "uncosted": analysis.uncosted(ops, n),
        "step_time_ms": _stats(analysis, raw.step_times_ms),
        "profiled_step_time_ms": _stats(analysis, raw.profiled_step_times_ms),
        "overhead": analysis.overhead(raw.profiled_step_times_ms, raw.step_times_ms),
        "communication": distributed.communication(busy, n),
        # DataLoader fetches and host-to-device copies per step, with the GPU idle inside them (all
        # device activity counts as busy, also the previous step's tail that belongs to no step).
        "input_wait": analysis.input_wait_by_step(
            trace.input_ranges(events), events.device if events.device_type == "cuda" else None,
            events.steps["step"].tolist()),
        "compile": compiled.summary_section(ops, getattr(raw, "inductor_kernels", None),
                                            getattr(raw, "compile_events", None)),
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
        # GPU runs only (None on a CPU run: no kernels); the under-used threshold is not fitted yet
        "top_kernels": _records(a["top_kernels"]) if a.get("top_kernels") is not None else None,
        "under_used_threshold": _threshold(),
        "idle_by_step": _records(idle),
        "input_wait_by_step": _records(a.get("input_wait")),
        "communication": a.get("communication"),
        "syncs": list(raw.syncs),
        "sync_steps": getattr(raw, "sync_steps", 0),  # steps the sync detector watched
        "routing": list(getattr(raw, "routing", None) or []),  # topk choices per module, shapes step
        "root_input_shapes": list(getattr(raw, "root_input_shapes", None) or []),  # per distinct shape set
        "losses": list(raw.losses),
        "loss_dtype": getattr(raw, "loss_dtype", None),
        "module_classes": dict(raw.module_classes),
        "wall_time_s": raw.wall_time_s,
        # torch.compile: Inductor kernel attribution, graph breaks, recompiles (analyze/compiled.py)
        "compile": a.get("compile") if a.get("compile") is not None
                   else _compile_without_analysis(raw),
    }


def _memory(raw) -> dict | None:
    """The memory breakdown of the shapes step (kprof/analyze/memory.py); None without a record.
    Its failure costs the memory section only, with the reason in the section."""
    from kprof.analyze import memory

    if not getattr(raw, "memory", None):
        return None
    try:
        return memory.from_record(raw.memory) or None
    except Exception as e:  # noqa: BLE001 - a bug here must not cost the profile
        return {"error": f"memory breakdown failed: {e!r}"}


def _threshold() -> dict:
    from kprof.analyze import efficiency

    return {"value": efficiency.UNDER_USED_THRESHOLD, "fitted": False,
            "note": "provisional; to be fitted on the 1B Llama with ncu counters (issue 26)"}


def _compile_without_analysis(raw) -> dict | None:
    """The graph breaks and recompiles, which need no trace, when the analysis failed or found
    nothing compiled."""
    from kprof.analyze import compiled

    msgs = getattr(raw, "compile_events", None)
    return compiled.compile_events(msgs) if msgs else None


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

"""kprof's command line: thin typer commands over the library (kprof.analyze.profile, kprof.store,
kprof.analyze.ceilings); rendering in kprof.cli.render. KprofError is caught once, in main()."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

import kprof
from kprof import store
from kprof.cli.console import console, err_console, stdout_to_stderr
from kprof.errors import KprofError

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() prints KprofError itself; anything else is a kprof bug
    context_settings={"help_option_names": ["-h", "--help"]},
)
JSON_HELP = "Print one JSON document on stdout instead of the report (the script's own output goes to stderr)."


def print_json(doc: dict) -> None:
    """The one JSON document a `--json` command prints on stdout (NaN/inf as null)."""
    print(json.dumps(store.jsonable(doc), indent=1, allow_nan=False))


def _version(value: bool) -> None:
    if value:
        console.print(f"kprof {kprof.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print kprof's version and exit.")] = None,
) -> None:
    """Profile PyTorch training steps on the roofline, suggest fused kernels, patch them in."""


# --------------------------------------------------------------------------------------------
# kprof profile


class StepMode(str, Enum):
    auto = "auto"
    optimizer = "optimizer"
    forward = "forward"


# The runner's phases, in order (kprof/capture/runner.py: run_script's progress events).
PHASES = {"warmup": "warmup (untimed)", "timing": "timed steps", "profiler-warmup": "profiler warm-up",
          "profiling": "profiled steps"}


class _LiveProgress:
    """Adapts the runner's progress(event, **info) callback to a rich display: one step counter
    per phase while the script runs, then a spinner for the analysis."""

    def __init__(self, progress: Progress):
        self.p = progress
        self.tasks: dict[str, int] = {}  # phase -> rich task id
        self.totals: dict[str, int] = {}
        self.spinner: int | None = None

    def __call__(self, event: str, **info) -> None:
        if event == "mode":
            self.p.console.print(Text(f"kprof: one step = {info.get('step_definition')}", style="dim"))
        elif event == "step":
            # A "step" event marks the boundary where step `index` of `phase` begins, so `index`
            # steps of that phase are done and every earlier phase is complete.
            phase, index, total = info.get("phase"), info.get("index", 0), info.get("total")
            order = list(PHASES)
            done_phases = order if phase == "done" else order[: order.index(phase)] if phase in order else []
            for ph in done_phases:
                if ph in self.tasks:
                    self.p.update(self.tasks[ph], completed=self.totals[ph])
            if phase in PHASES and total:
                if phase not in self.tasks:
                    self.tasks[phase] = self.p.add_task(PHASES[phase], total=total)
                self.totals[phase] = total
                self.p.update(self.tasks[phase], completed=index, total=total)
        elif event in ("export", "analysis", "save"):
            label = {"export": "exporting the trace", "analysis": "analysing the trace",
                     "save": "saving the run"}[event]
            if self.spinner is None:
                self.spinner = self.p.add_task(label, total=None)
            else:
                self.p.update(self.spinner, description=label)


@contextmanager
def _live() -> Iterator[_LiveProgress | None]:
    # The live display goes to stderr so piped stdout stays the script's output plus the report.
    if not err_console.is_terminal:
        yield None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    # The script's prints are routed above the live display, but only when stdout is the same
    # terminal: `kprof profile x.py > log` must still put the script's output in the log.
    with Progress(*columns, console=err_console, transient=True, redirect_stdout=sys.stdout.isatty(),
                  redirect_stderr=True) as p:
        yield _LiveProgress(p)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def profile(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="The training script to run, unmodified. "
                                                "Arguments after `--` go to the script.")],
    warmup: Annotated[int, typer.Option(help="Steps run before timing starts (compilation, "
                                             "autotuning, allocator warm-up).")] = 3,
    steps: Annotated[int, typer.Option(help="Steps timed without the profiler, and again under it.")] = 5,
    run_to_end: Annotated[bool, typer.Option("--run-to-end", help="Let the script finish instead "
                                             "of stopping it after the recorded steps.")] = False,
    step: Annotated[StepMode, typer.Option("--step", help="What one step is: optimizer (each "
                                      "optimizer.step()), forward (each call of the outermost "
                                      "module) or auto (optimizer if the script has one).")] = StepMode.auto,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
    json_out: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="Run SCRIPT under torchrun "
                              "with N processes; every rank is profiled and rank 0 saves one merged run. "
                              "Under your own torchrun this happens without the option.")] = None,
    ncu: Annotated[bool, typer.Option("--ncu", help="Then re-run one step under Nsight Compute (ncu) "
                                      "for the top kernels' hardware counters, shown beside kprof's "
                                      "class; ~0.4 s per kernel launch.")] = False,
    ncu_top: Annotated[int, typer.Option("--ncu-top", min=1, help="Kernels (by time) that --ncu "
                                         "measures.")] = 20,
) -> None:
    """Run SCRIPT under the profiler and show where each step's time goes, on the roofline."""
    from kprof.analyze.profile import profile_script, rank_env
    from kprof.cli import render as report

    argv = list(ctx.args)
    if nproc_per_node is not None:
        if json_out or ncu:
            from kprof.errors import KprofError

            raise KprofError("--json and --ncu go with one process; with --nproc-per-node, run `kprof report "
                             "--json` on the merged run afterwards", exit_code=2)
        # The ranks print (rank 0 the merged report); this process only waits for them.
        run = profile_script(str(script), argv, warmup=warmup, steps=steps, run_to_end=run_to_end,
                             step_mode=step.value, out_root=out, nproc_per_node=nproc_per_node)
        raise typer.Exit(_exit_code(run.summary))
    ncu_path = _find_ncu() if ncu else None
    if ncu and ncu_path is None:
        from kprof.capture.ncu import HINT

        err_console.print(Text(HINT, style="yellow"))
    rank = rank_env()
    quiet = rank is not None and rank["rank"] != 0
    with stdout_to_stderr(json_out), (nullcontext() if quiet else _live()) as live:
        run = profile_script(str(script), argv, warmup=warmup, steps=steps, run_to_end=run_to_end,
                             step_mode=step.value, out_root=out, progress=live)
    if quiet:
        err_console.print(f"kprof: rank {rank['rank']} of {rank['world_size']} recorded; rank 0 saves the merged run")
        raise typer.Exit(_exit_code(run.summary))
    ncu_doc = _ncu_cross_check(run, ncu_path, ncu_top, json_out) if ncu_path else None
    if json_out:
        print_json(_run_doc(run.summary, run.path) | ({"ncu": ncu_doc} if ncu else {}))
    else:
        report.render(run.summary, run.path, console)
        if ncu_doc is not None:
            console.print(report.kernels_table(run.summary, console.width))
            console.print(report.ncu_table(ncu_doc, console.width))
    failed = partial_run_error(run.summary, run.path)
    if failed is not None:
        raise failed


def _exit_code(summary: dict) -> int:
    if summary.get("status") == "error":
        return summary.get("exit_code") or 1
    if summary.get("status") == "interrupted":
        return 130  # 128 + SIGINT, the shell's convention
    return 0


def _find_ncu() -> str | None:
    from kprof.capture.ncu import find_ncu

    return find_ncu()


def _ncu_cross_check(run, ncu_path: str, top: int, json_out: bool) -> dict | None:
    """--ncu after the run is saved: say how long it will take, measure, store ncu.json. A run
    without kernels (CPU) or a failed step is reported in one line and skipped."""
    import tempfile

    from kprof.analyze import ncu

    if run.summary.get("status") not in ("completed", "stopped"):
        err_console.print(Text("--ncu: skipped, the script did not finish its recorded steps", style="yellow"))
        return None
    selected = ncu.select(ncu.plan(run), top)
    if selected.empty:
        err_console.print(Text("--ncu: no device kernels in this run (a CPU run); nothing to measure", style="yellow"))
        return None
    secs = ncu.estimate_seconds(selected)
    err_console.print(Text(f"ncu: measuring the top {len(selected)} kernels, {int(selected['launches/step'].sum())} "
                           f"launches in one step, about {secs:.0f} s at {ncu.SECONDS_PER_LAUNCH} s per launch",
                           style="dim"))
    with tempfile.TemporaryDirectory(prefix="kprof-ncu-") as d, stdout_to_stderr(json_out):
        return ncu.cross_check(run, selected, ncu_path, d)


def partial_run_error(summary: dict, path: Path) -> KprofError | None:
    """The one-line error (and exit code) for a run the script did not finish cleanly: it raised
    (1, its own exit code named) or was interrupted (130); the partial run is kept and marked."""
    from kprof.errors import INTERRUPTED, SCRIPT_FAILED

    n = summary.get("steps_recorded") or 0
    if summary.get("status") == "error":
        return KprofError(f"{Path(str(summary.get('script'))).name} failed (exit code {summary.get('exit_code')}) "
                          f"after {n} recorded step{'s' if n != 1 else ''}; the partial run is kept in {path}, marked "
                          "error; fix the script (its traceback is above) and profile again", exit_code=SCRIPT_FAILED)
    if summary.get("status") == "interrupted":
        return KprofError(f"interrupted after {n} recorded step{'s' if n != 1 else ''}; the partial run is kept in "
                          f"{path}, marked interrupted", exit_code=INTERRUPTED)
    return None


# --------------------------------------------------------------------------------------------
# kprof runs / report / calibrate


def _run_doc(summary: dict, path: Path | None) -> dict:
    """`--json` of profile and report: the run's name, folder and summary.json as saved."""
    return {"run": path.name if path else None, "path": str(path) if path else None, "summary": summary}


@app.command()
def runs(
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
    json_out: Annotated[bool, typer.Option("--json", help="Print the runs as one JSON document.")] = False,
) -> None:
    """List saved runs, oldest first."""
    from kprof.cli import render as report

    paths = store.list_runs(out)
    if not paths and not json_out:
        console.print(f"no runs in {out}; profile a script first: kprof profile SCRIPT")
        return
    recs = []
    for p in paths:
        try:
            s = store.load_summary(p)
        except KprofError as e:  # one broken run must not hide the others
            recs.append(dict(run=p.name, path=str(p), status="unreadable", error=str(e)))
            continue
        # A patched run of kprof apply (partial ones too) says so: it is not a plain profile.
        status = s.get("status", "?") + (" (apply)" if s.get("apply_of") is not None else "")
        recs.append(dict(run=p.name, path=str(p), status=status,
                         device=(s.get("device") or {}).get("name", "?"), step=s.get("step_definition") or "?",
                         step_time_ms=(s.get("step_time_ms") or {}).get("median"),
                         steps=s.get("steps_recorded")))
    if json_out:
        print_json({"root": str(out), "runs": recs})
        return
    rows = [dict(run=r["run"], status="[red]unreadable[/red]", device="", step="", **{"ms/step": "", "steps": ""})
            if "error" in r else
            dict(run=r["run"], status=r["status"], device=r["device"], step=r["step"],
                 **{"ms/step": report.fmt_ms(r["step_time_ms"]), "steps": str(r["steps"] if r["steps"] is not None
                                                                             else "?")})
            for r in recs]
    report.render_runs(rows, console)
    for r in recs:
        if "error" in r:
            console.print(Text(r["error"], style="red"))


# `--html` alone: the report goes into the run's folder (a name no user file would have).
DEFAULT_HTML = "<run>/report.html"


@app.command("report")
def report_cmd(
    run: Annotated[Optional[str], typer.Argument(help="Run directory or name; default: the latest.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
    json_out: Annotated[bool, typer.Option("--json", help="Print the run as one JSON document.")] = False,
    memory: Annotated[bool, typer.Option("--memory", help="Show where the step's peak memory goes.")] = False,
    kernels: Annotated[bool, typer.Option("--kernels", help="Show the top kernels (every kernel is its "
                                          "own row) and, after `profile --ncu`, ncu's counters beside "
                                          "kprof's class, instead of the per-op report.")] = False,
    html: Annotated[Optional[str], typer.Option(
        "--html", metavar="[FILE]",
        help="Write a self-contained HTML report (roofline, step timeline, module tree, top ops, syncs, "
             "suggestions; of an apply's run, the before/after view; no network needed to view it) to FILE, "
             "default <run>/report.html.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html replace an existing file (kept as FILE.bak, "
                                        "or the next free FILE.bak.N).")] = False,
) -> None:
    """Show a saved run's report again."""
    from kprof.cli import render as report

    r = store.load_run(run, out)
    if html is not None:
        _write_html(r, html, force=force, json_out=json_out, root=out)
        return
    if memory:
        if json_out:
            print_json({"run": r.name, "memory": r.summary.get("memory")})
        else:
            console.print(report.memory_section(r.summary, console.width))
        return
    compared = (Path(r.path) / store.COMPARE).is_file()  # one variant of `kprof apply --compare`
    ncu_doc = store.read_json(r.path, store.NCU)
    if json_out:
        from kprof.patching.compare import load_compare

        print_json(_run_doc(r.summary, Path(r.path)) | {"compare": load_compare(r.path) if compared else None}
                   | ({"ncu": ncu_doc} if kernels else {}))
        return
    if kernels:
        console.print(report.kernels_table(r.summary, console.width))
        if ncu_doc is not None:
            console.print(report.ncu_table(ncu_doc, console.width))
        return
    report.render(r.summary, r.path, console)
    if compared:  # show the whole comparison
        from kprof.cli.patch_cmds import render_compare
        from kprof.patching.compare import CompareResult, load_compare

        console.print()
        render_compare(CompareResult.from_dict(load_compare(r.path)), console)


def _write_html(r: store.Run, html: str, *, force: bool, json_out: bool, root: Path) -> None:
    """`kprof report --html`: the report of what the run has; a missing or corrupt op table,
    trace or plan is named in the page (and on stderr), never an error."""
    path, bak, missing = write_html(r, html, force=force, root=root)
    if json_out:
        print_json({"run": r.name, "html": str(path), "backup": str(bak) if bak else None, "missing": missing})
        return
    for m in missing:
        err_console.print(Text(f"missing: {m}", style="yellow"))
    console.print(Text(f"report {path}" + (f" (the old file kept as {bak})" if bak else "")))


def html_path(run_path: Path, html: str) -> Path:
    return Path(run_path) / "report.html" if html == DEFAULT_HTML else Path(html)


def write_html(r: store.Run, html: str, *, force: bool, root: Path, rules_dir: str | None = None,
               checked: bool = False) -> tuple[Path, Path | None, list[str]]:
    """Write the HTML report of run `r` (the before/after view for the run of a `kprof apply`):
    (the file, its backup or None, what the run lacks). `checked`: the target was refused or
    accepted already (apply checks it before its runs)."""
    import os
    from urllib.parse import quote

    from kprof.analyze.report import report_data
    from kprof.cli import html as page

    path = html_path(r.path, html)
    if not checked:
        store.check_write_target(path, force=force, option="--html", example="report.html")
    missing: list[str] = []
    ops = _html_ops(Path(r.path), missing)
    missing += _trace_problem(Path(r.path))
    view = _apply_view(r, root, missing)
    before = b_ops = None
    if view is not None:
        doc, before = view
        if before is not None:
            b_ops = _html_ops(Path(before.path), missing, f"before run {before.name}: ")
        plan = _html_plan(before, missing, f"{store.PLAN} of the before run {before.name}: none; the patches' "
                          "module paths are matched again") if before else None
    else:
        plan = _html_plan(r, missing, f"{store.PLAN}: no suggestions yet; run `kprof suggest {r.name}`")
    trace = Path(r.path) / store.TRACE
    d = report_data(r.summary, ops, plan, run_name=r.name, missing=missing,
                    trace_path=str(trace) if trace.is_file() else None)
    if trace.is_file():  # relative to the page, as a URL
        d["trace_href"] = quote(Path(os.path.relpath(trace.resolve(), path.resolve().parent)).as_posix())
    d["meta"] = page.run_meta(r.summary)
    d["timeline"] = page.step_timeline(r.summary, ops)
    d["modules"] = page.module_tree(ops, page.n_steps(r.summary, ops), r.summary.get("module_classes"),
                                    b_ops, page.n_steps(before.summary if before else None, b_ops))
    if view is not None:
        from kprof.rules import MEMORY_RULES, all_rules

        if b_ops is not None:  # the roofline is the before run's, the arrows start on it
            bd = report_data(before.summary, b_ops, None, run_name=before.name)
            d["points"], d["ceilings"], d["roofline_of"] = bd["points"], bd["ceilings"], before.name
        d["before_after"] = page.before_after(doc, [*all_rules(rules_dir), *MEMORY_RULES],
                                              before_summary=before.summary if before else None, before_ops=b_ops,
                                              before_plan=plan, after_summary=r.summary, after_ops=ops)
    bak = store.write_keep_file(path, page.render_html(d))
    return path, bak, missing


def _html_ops(run_path: Path, missing: list[str], who: str = ""):
    try:
        return store.load_ops(run_path)
    except KprofError as e:  # the summary's own tables still make a report
        missing.append(f"{who}op table: {e}; the roofline needs it")
        return None


def _html_json(run_path: Path, name: str, missing: list[str], then: str = "") -> dict | None:
    """A run's JSON file, None where absent or corrupt (named in `missing`, with `then`)."""
    try:
        return store.read_json(run_path, name)
    except KprofError as e:
        missing.append(f"{name}: {e}{then}")
        return None


def _html_plan(r: store.Run, missing: list[str], absent: str) -> dict | None:
    if not (Path(r.path) / store.PLAN).is_file():
        missing.append(absent)
    return _html_json(Path(r.path), store.PLAN, missing)


def _apply_view(r: store.Run, root: Path, missing: list[str]) -> tuple[dict, store.Run | None] | None:
    """For the patched run of a `kprof apply`: its apply.json (or, for an apply that did not finish,
    the `apply_of` mark in its summary) and its before run, looked for beside it, then in `root`.
    None for any other run."""
    mark = r.summary.get("apply_of") or {}
    if (Path(r.path) / store.APPLY).is_file():
        doc = _html_json(Path(r.path), store.APPLY, missing, "; no before/after view")
        if not isinstance(doc, dict):
            if doc is not None:
                missing.append(f"{store.APPLY} is not an apply result (not a JSON object); no before/after view")
            return None
    elif not mark:
        return None
    else:
        doc = {"before_run": mark.get("run"), "after_run": r.name,
               "patches": [{"id": p} for p in mark.get("patches") or []]}
        missing.append(f"{store.APPLY}: this apply did not finish (no ablation, no measured savings); its patches "
                       "are those of the apply_of mark in summary.json")
    name = str(doc.get("before_run") or mark.get("run") or "")
    for cand in ([Path(r.path).parent / name, Path(root) / name] if name else []):
        if (cand / store.SUMMARY).is_file():
            try:
                return doc, store.load_run(cand)
            except KprofError as e:
                missing.append(f"before run {name}: {e}; the roofline is this run's, without arrows")
                return doc, None
    missing.append(f"before run {name or '?'}: not found beside this run or in {root}; the roofline is this "
                   "run's, without arrows")
    return doc, None


def _trace_problem(run_path: Path) -> list[str]:
    """Why the run's trace can't be opened, or nothing. Only the start is read: a GPU trace can be
    hundreds of MB, and a file that isn't gzip'd JSON shows in its first bytes; a trace cut short
    at its end is not caught here (Perfetto will say so)."""
    import gzip
    import zlib

    p = run_path / store.TRACE
    if not p.is_file():
        return [f"{store.TRACE}: the run has no trace, so no timeline to open in https://ui.perfetto.dev"]
    try:
        with gzip.open(p, "rb") as f:
            head = f.read(4096).lstrip()
    except (OSError, EOFError, zlib.error) as e:
        return [f"{store.TRACE} is corrupt ({e}); the timeline can't be opened"]
    if not head.startswith(b"{"):
        return [f"{store.TRACE} is corrupt (not a JSON trace); the timeline can't be opened"]
    return []


@app.command()
def calibrate(
    quick: Annotated[bool, typer.Option("--quick", help="Smaller sizes and fewer repeats: "
                                        "seconds instead of a minute, less accurate.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the ceilings as one JSON document.")] = False,
) -> None:
    """Measure this device's memory bandwidth, matmul peaks and launch latency; cache them."""
    from dataclasses import asdict

    from kprof.analyze import ceilings
    from kprof.capture.runner import device_info
    from kprof.cli import render as report

    dev = device_info()
    with err_console.status(f"measuring {dev.get('name', 'the device')}{' (quick)' if quick else ''}..."):
        c = ceilings.calibrate(dev, quick=quick)
    if json_out:
        print_json({"ceilings": asdict(c), "cache": str(ceilings.cache_path(dev))})
    else:
        report.render_ceilings(asdict(c), str(ceilings.cache_path(dev)), console)


# `kprof suggest` and `kprof apply` live in kprof/cli/patch_cmds.py, beside the rule engine they drive.
from kprof.cli import patch_cmds as cli_patch

cli_patch.register(app)


def html_default(argv: list[str]) -> list[str]:
    """`kprof report --html` and `kprof apply --html` with no FILE (last, or followed by another
    option) get DEFAULT_HTML: typer has no options with an optional value, so main() fills it in
    before parsing. What follows `--` is the script's."""
    if next((a for a in argv if not a.startswith("-")), None) not in ("report", "apply"):
        return argv
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a == "--":
            return out + argv[i + 1:]
        if a == "--html" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append(DEFAULT_HTML)
    return out


def _on_sigterm(signum, frame) -> None:
    # SIGTERM (a job scheduler, `kill`) takes the Ctrl-C path: the runner keeps the steps
    # recorded so far, and the command ends with exit code 130 saying what was kept.
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> None:
    """Entry point; the one place a KprofError becomes a red message and its exit code
    (kprof.errors: 1 the script failed, 2 bad input, 3 a patch failed, 130 interrupted). Click
    handles its own usage errors (exit 2) in standalone mode, and typer exits 130 on an
    interrupt that reaches it (the commands catch the ones that cost work, saying what was kept)."""
    import signal
    import threading

    argv = html_default(list(sys.argv[1:] if argv is None else argv))
    restore = None
    if threading.current_thread() is threading.main_thread():
        restore = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app(args=argv, prog_name="kprof")
    except KprofError as e:
        if e.detail:
            err_console.print(Text(e.detail.rstrip()), markup=False, highlight=False)
        err_console.print(Text("error: ", style="bold red") + Text(str(e), style="red"))
        sys.exit(e.exit_code)
    finally:
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)

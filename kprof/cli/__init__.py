"""kprof's command line: thin typer commands over the library (kprof.analyze.profile, kprof.store,
kprof.analyze.ceilings); rendering in kprof.cli.render. KprofError is caught once, in main()."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
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
) -> None:
    """Run SCRIPT under the profiler and show where each step's time goes, on the roofline."""
    from kprof.analyze.profile import profile_script
    from kprof.cli import render as report

    argv = list(ctx.args)
    with stdout_to_stderr(json_out), _live() as live:
        run = profile_script(str(script), argv, warmup=warmup, steps=steps, run_to_end=run_to_end,
                             step_mode=step.value, out_root=out, progress=live)
    if json_out:
        print_json(_run_doc(run.summary, run.path))
    else:
        report.render(run.summary, run.path, console)
    failed = partial_run_error(run.summary, run.path)
    if failed is not None:
        raise failed


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


@app.command("report")
def report_cmd(
    run: Annotated[Optional[str], typer.Argument(help="Run directory or name; default: the latest.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
    json_out: Annotated[bool, typer.Option("--json", help="Print the run as one JSON document.")] = False,
) -> None:
    """Show a saved run's report again."""
    from kprof.cli import render as report

    r = store.load_run(run, out)
    compared = (Path(r.path) / store.COMPARE).is_file()  # one variant of `kprof apply --compare`
    if json_out:
        from kprof.patching.compare import load_compare

        print_json(_run_doc(r.summary, Path(r.path)) | {"compare": load_compare(r.path) if compared else None})
        return
    report.render(r.summary, r.path, console)
    if compared:  # show the whole comparison
        from kprof.cli.patch_cmds import render_compare
        from kprof.patching.compare import CompareResult, load_compare

        console.print()
        render_compare(CompareResult.from_dict(load_compare(r.path)), console)


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

"""`kprof suggest` and `kprof apply`: thin typer commands over kprof.plan.suggest and kprof.patching.apply, and
their rendering. kprof.cli registers them with `patch_cmds.register(app)`; a
KprofError raised here is printed by kprof.cli.main like any other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from kprof import store
from kprof.cli.console import console, err_console, stdout_to_stderr
from kprof.cli.render import Col, fit


def _f(v, fmt: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "?"
    return fmt.format(v)


def _plan_cells(r: dict) -> list:
    """The cells of one row of the ranked plan (kprof.plan.suggest.ranked): a kernel suggestion
    or a diagnosis."""
    known = r["saving ms/step"] == r["saving ms/step"]
    src = r.get("source") or ""
    where = "\n".join(dict.fromkeys(x for x in (r["where"], r.get("module_class") or "", src) if x and x == x))
    if r["kind"] == "kernel":
        evidence = (f"{_f(r['ms/step'])} ms/step ({_f(r['% of step'], '{:.1f}')}% of step), "
                    f"{r['class']}, {_f(r['% of roofline'], '{:.0f}')}% of roofline")
        note = ""
    else:
        evidence = str(r["evidence"])
        note = str(r.get("saving note") or "")
    bound = "<= " if note.startswith("upper bound") else ""
    saving = f"{bound}{_f(r['saving ms/step'])} ms/step ({_f(r['saving %'], '{:.1f}')}% of step)" if known else "?"
    saving += f"\n{note}" if note else ""
    # Data cells as Text: code in evidence and how (`x[i]`) must not read as rich markup.
    return [str(r["rank"]), Text(r["id"]), Text(where), Text(evidence), Text(str(r["change"])), Text(saving),
            Text(str(r["confidence"])), Text(str(r["how"]) + diff_lines(r.get("diff"), bool(r.get("applyable"))))]


DIFF_LINES = 4  # changed lines shown in the plan; the whole diff is in the run's diffs/ folder


def diff_lines(d, applyable: bool = False) -> str:
    """The plan cell's view of a diff record: where the patch file is and its first changed
    lines, or why there is no exact change (not for what `kprof apply` installs: its `how` says
    so already)."""
    if not isinstance(d, dict):
        return ""
    if not d.get("unified_diff"):
        return f"\nno exact diff: {d['reason']}" if d.get("reason") and not applyable else ""
    changed = [ln for ln in d["unified_diff"].splitlines()
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    shown = "\n".join(changed[:DIFF_LINES])
    more = f"\n(+{len(changed) - DIFF_LINES} more lines)" if len(changed) > DIFF_LINES else ""
    cmd = d.get("command") or f"patch -p0 < {d.get('patch_file') or '?'}"
    return f"\ndiff at {d['file']}:{d['line']}: {cmd}\n{shown}{more}"


PLAN_COLUMNS = [Col("#", justify="right", number=True), Col("id", number=True), Col("where"), Col("evidence"),
                Col("change"), Col("est. saving"), Col("confidence", number=True), Col("how")]


def render_plan(plan: pd.DataFrame, run_name: str, plan_path: Path | None, out: Console | None = None,
                diagnoses: pd.DataFrame | None = None) -> None:
    """Kernel suggestions and diagnoses in one table, ranked by estimated saving (unknown last);
    one block per row where the table doesn't fit the terminal."""
    from kprof.plan.suggest import ranked

    out = out or console
    both = ranked(plan, diagnoses)
    if not len(both):
        out.print(f"kprof suggest: no pattern kprof can fix was found in run {run_name}.")
        return
    what = "suggestions" if len(plan) else "diagnoses (no kernel pattern found)"
    title = Text(f"{what} for {run_name}, ranked by estimated saving ("
                 + (f"saved to {plan_path})" if plan_path else "not saved)"), style="italic")
    # A host-bound run's caveat is the same on every kernel row (kprof.analyze.modules.host_bound): once.
    caveats = dict.fromkeys(c for c in (plan["caveat"] if "caveat" in plan else []) if c)
    for c in caveats:
        out.print(f"caveat: {c}", style="yellow", markup=False)
    out.print(fit(PLAN_COLUMNS, [_plan_cells(r) for r in both.to_dict("records")], out.width, title=title,
                  head=(0, 1), show_lines=True))
    if len(plan):
        out.print("estimated saving = measured time of the matched ops - the replacement's roofline time at "
                  "the same shapes (kernel spec FLOPs/bytes at this run's ceilings); a diagnosis states its "
                  "own basis", style="dim")


def suggest_cmd(
    run: Annotated[Optional[str], typer.Argument(help="Run directory or name (default: the latest).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    rules: Annotated[Optional[Path], typer.Option("--rules", help="A folder of extra rule files "
                                                   "(see examples/custom_rules/); they take precedence.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
) -> None:
    """Rank fixes for a profiled run by estimated saving, with evidence: fused kernels and SDPA
    (`kprof apply` patches them) and the diagnoses no kernel fixes (host syncs, fp32 matmuls,
    unfused optimizer: script changes)."""
    from kprof.plan.suggest import PLAN, plan_doc, save_plan, suggest
    from kprof.rules import all_rules
    from kprof.rules.diagnoses import diagnose

    # The same default run as `kprof apply`: the latest run of a script as written.
    r = store.load_run(run, out) if run is not None else store.latest_plain_run(out)
    plan = suggest(r, all_rules(str(rules) if rules else None))
    diag = diagnose(r)
    try:
        path: Path | None = save_plan(r, plan, diag)
        unsaved = None
    except OSError as e:  # a read-only store: the plan is still worth showing
        path, unsaved = None, f"plan.json was not saved in {r.path} ({e.strerror or e}); kprof apply computes it again"
    if json_out:
        # plan.json's document, and where it was saved
        print(json.dumps({"plan": str(path) if path else None} | plan_doc(r, plan, diag), indent=1, allow_nan=False))
    else:
        render_plan(plan, r.name, path, diagnoses=diag)
    if unsaved:
        err_console.print(Text("warning: " + unsaved, style="yellow"))


def render_apply(res, out: Console | None = None) -> None:
    out = out or console
    w = out.width
    for rep in res.reports:
        rows = []
        for rec in rep.records:
            style = {"verified": "green", "reverted": "red"}.get(rec.status, "yellow")
            rows.append([Text(rec.rule), Text(rec.path or "<model>"), Text(rec.status, style=style),
                         Text(rec.verification.summary() if rec.verification else "not called"), Text(rec.source)])
        out.print(fit([Col("rule", number=True), Col("where"), Col("status", number=True), Col("verification"),
                       Col("source")], rows, w, title="patches (verified on their first call against the original code)",
                      head=(0, 1)))
    num = dict(justify="right", number=True)
    out.print(fit([Col("metric"), Col("before", **num), Col("after", **num), Col("change %", **num)],
                  [[Text(r["metric"]), _f(r["before"]), _f(r["after"]), _f(r["change %"], "{:+.1f}")]
                   for r in res.steps.to_dict("records")], w,
                  title=f"before ({res.before.name}) vs after ({res.after.name})"))
    if not res.kept:
        # Two processes of the same code: 64.1 against 54.4 ms on the 150M Llama (H200).
        out.print("[yellow]nothing was kept, so before and after ran the same code: their difference is "
                  "run-to-run noise[/yellow]")
    _render_ablation(res, out)
    out.print(fit([Col("step", **num), Col("before", **num), Col("after", **num), Col("rel diff", **num)],
                  [[str(r["step"]), f"{r['before']:.6f}", f"{r['after']:.6f}", f"{r['rel diff']:.2e}"]
                   for r in res.losses.to_dict("records")], w, title="first losses"))
    w = res.watch
    if w is not None and w["diverged"]:
        out.print(f"[red]loss diverged at step {w['step']}: {w['after']:.6g} patched vs {w['before']:.6g} unpatched, "
                  f"|diff| {w['delta']:.2e} > {w['k']:g} x the unpatched runs' spread or the loss's own precision "
                  f"({w['limit']:.2e})[/red]")
    elif w is not None:
        out.print(f"[green]losses agree over all {w['steps']} steps: |diff| at most {w['max_delta']:.2e}, within "
                  f"{w['k']:g} x the spread of two unpatched runs ({w['spread']:.2e}) or the loss's own precision[/green]")
    elif res.losses_agree is True:
        out.print(f"[green]first loss agrees within the patched dtype's tolerance (rtol {res.loss_tolerance:g})[/green]")
    elif res.losses_agree is False:
        out.print(f"[red]first loss differs beyond the tolerance (rtol {res.loss_tolerance:g}): is the script "
                  "seeded? If it is, report this with both run directories[/red]")
    else:
        out.print("[yellow]losses not compared (no losses recorded or no patch kept)[/yellow]")
    for n in res.notes:
        out.print(f"[yellow]note:[/yellow] {escape(n)}")
    out.print(f"[bold]recommendation:[/bold] {escape(res.recommendation)}")


def _render_ablation(res, out: Console) -> None:
    """Per planned patch, the ablation's verdict as a stacked record (80 columns): predicted vs
    measured saving with n and the spread, memory, and the reason; then what was not installed."""
    a = res.ablation
    if a is not None:
        out.print(f"[bold]ablation[/bold]: {a.steps} timed steps, {a.blocks} blocks, {len(a.groups)} group(s); "
                  "paired sign test, 95% interval")
    elif res.declined:
        out.print(f"[yellow]ablation declined:[/yellow] {escape(res.declined)}")
    c = res.compiled
    if c is not None:
        # The script compiles its model: every figure below is kprof + compile against compile.
        out.print("[bold]active under compile[/bold]: " + escape(", ".join(c["active"]) or "none"))
        for r in c["stepped_aside"]:
            out.print(Text(f"stepped aside under compile: {r['id']} ({r['verdict']}, saving "
                           f"{_f(r['measured_saving_ms'], '{:.3g}')} ms/step)"))
    style = {"kept": "green", "dropped": "red"}
    for r in res.suggestions.to_dict("records"):
        st = style.get(r["verdict"], "yellow")
        out.print(f"[bold]{escape(r['id'])}[/bold]: [{st}]{r['verdict']}[/{st}]"
                  + (" (installed in the after run)" if r["kept"] else ""))
        meas = _f(r["measured_saving_ms"], "{:.3g}")
        if r["n"]:
            meas += f" (n={r['n']}, spread ±{_f(r['spread_ms'], '{:.3g}')})"
        lines = [f"where: {r['where'] or '?'}", f"verified: {r['verified modules']}/{r['modules']} modules",
                 f"saving ms/step: predicted {_f(r['predicted_saving_ms'], '{:.3g}')}, measured {meas}"]
        mem = r["memory_saving_bytes"]
        if mem is not None and mem == mem:
            lines.append(f"peak memory saved: {mem / 2**20:.0f} MiB")
        lines.append(f"reason: {r['reason']}")
        for ln in lines:
            out.print(Text("  " + ln))
    for n in res.not_installed:
        out.print(f"[yellow]not installed:[/yellow] {escape(n['id'])}: {escape(n['why'])}")
    if res.batch_headroom:
        out.print(f"memory: the kept set fits a {res.batch_headroom:.2f}x batch in the same peak (basis: "
                  "activations scale with the batch; weights, gradients and optimizer state don't)")


def _ms(x) -> str:
    if x is None or not math.isfinite(x):
        return "?"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _mem(b) -> str:
    if b is None:
        return "?"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _first_line(text: str | None, n: int = 90) -> str:
    """The telling line of an error: a traceback's `SomeError: message` line, else its first line."""
    import re

    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Interrupt)\b.*", ln)]
    line = exc[-1] if exc else (lines[0] if lines else "")
    return line if len(line) <= n else line[: n - 1] + "…"


def render_compare(res, out: Console | None = None) -> None:
    """The --compare table, its notes and the verdict (kprof.patching.compare.CompareResult)."""
    out = out or console
    dev = res.device or {}
    kind = "CPU" if res.cpu else "GPU"
    title = (f"kprof apply --compare: {Path(res.script).name} on {dev.get('name', '?')} ({kind}), "
             f"{res.warmup} warm-up + {res.steps} timed steps per variant")
    # Compact cells, the long text in the notes below; one block per variant where the table
    # doesn't fit (an 80-column terminal, the H200 machine's).
    cols = [Col("variant", number=True)] + [Col(c, justify="right", number=True) for c in (
        "ms/step", "p10-p90", "vs eager", "peak memory", "warm-up s", "loss @step", "loss diff")] + [Col("details")]
    rows = []
    eager = res.row("eager")
    for r in res.variants:
        details = []
        if r.patches:
            ok = sum(p["status"] == "verified" for p in r.patches)
            bad = sum(p["status"] == "reverted" for p in r.patches)
            details.append(f"{ok}/{len(r.patches)} verified" + (f", [red]{bad} reverted[/red]" if bad else ""))
        elif "kprof" in r.variant and r.status == "ok":
            details.append("[yellow]no patch matched[/yellow]")
        if r.compile:
            gb = r.compile.get("graph_breaks")
            style = "green" if gb == 0 else "yellow"
            details.append(f"{_f(r.compile.get('graphs'), '{:d}')} graphs, [{style}]{_f(gb, '{:d}')} breaks[/{style}]")
        if r.status == "failed":
            details.append("[red]failed (below)[/red]")
        elif r.status == "skipped":
            details.append(f"[yellow]skipped: {escape(_first_line(r.error, 200))}[/yellow]")
        st = r.step_time_ms or {}
        spread = f"{_ms(st.get('p10'))}-{_ms(st.get('p90'))}" if st.get("median") is not None else ""
        warm = ""
        if r.warmup_s is not None:
            warm = f"{r.warmup_s:.2f}"
            if r is not eager and eager is not None and eager.warmup_s is not None:
                warm += f" ({r.warmup_s - eager.warmup_s:+.2f})"
        loss = f"{r.first_loss:.6g} @{r.loss_step}" if r.first_loss is not None else ""
        if r.variant == "eager" or r.loss_agree is None:
            agree = "" if r.variant == "eager" or r.first_loss is None else "not compared"
        else:
            agree = (f"[green]{r.loss_rel_diff:.1e} ok[/green]" if r.loss_agree
                     else f"[red]{r.loss_rel_diff:.1e} DIFFERS[/red]")
        speed = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        name = r.variant if r.status == "ok" else f"[dim]{r.variant}[/dim]"
        rows.append([name, _ms(st.get("median")) if st else "", spread, speed,
                     _mem(r.peak_memory_bytes) if r.run else "", warm, loss, agree, "\n".join(details)])
    out.print(fit(cols, rows, out.width, title=title))
    kind_mem = next((r.peak_memory_kind for r in res.variants if r.peak_memory_kind), "")
    out.print(f"ms/step: median of the timed steps (unprofiled); vs eager: eager's median / this one's; warm-up: "
              f"first module call to the first timed step (+ vs eager); peak memory: {kind_mem or '?'}; loss @step: "
              "the first step run wholly with the variant's code; loss diff: relative to eager's loss at that step "
              "(the steps before ran the script as written)", style="dim")
    for r in res.variants:
        if r.status == "failed":
            lines = (r.error or "").strip().splitlines()
            shown = lines if len(lines) <= 12 else lines[:3] + ["  ..."] + lines[-8:]
            out.print(f"[red]{r.variant} failed:[/red]")
            for ln in shown:
                out.print(f"  {ln}", markup=False, highlight=False)
    # The same note on several rows (e.g. both kprof rows) once, naming the rows.
    grouped: dict[str, list[str]] = {}
    for r in res.variants:
        if r.compile and r.compile.get("break_reasons"):
            for reason in r.compile["break_reasons"]:
                grouped.setdefault(f"graph breaks: {reason}", []).append(r.variant)
        for n in r.notes:
            grouped.setdefault(n, []).append(r.variant)
    for n, rows in grouped.items():
        out.print(f"[yellow]note ({', '.join(rows)}):[/yellow] {n}")
    kprof_rows = [r for r in res.variants if r.patches]
    if kprof_rows:
        by_rule: dict[str, int] = {}
        for p in kprof_rows[0].patches:
            by_rule[p["rule"]] = by_rule.get(p["rule"], 0) + 1
        out.print(f"kprof patches (plan of run {res.plan_run}): "
                  + ", ".join(f"{k} x{n}" if n > 1 else k for k, n in by_rule.items()))
    for n in res.notes:
        out.print(f"[yellow]note:[/yellow] {n}")
    out.print(f"[bold]verdict: {res.verdict}[/bold]")
    for r in res.variants:
        if r.run:
            out.print(f"run  {r.variant:14s} {r.run}", highlight=False)
    if res.saved:
        out.print(f"compare.json saved in each variant's run, e.g. {res.saved[0]}", highlight=False)


def _compare_progress(event: str, **info) -> None:
    i, n, v = info.get("index", 0) + 1, info.get("total", 0), info.get("variant")
    if event == "start":
        err_console.print(f"[dim]kprof compare: running {v} ({i}/{n}) in its own process...[/dim]")
    elif event == "done":
        r = info["result"]
        what = "ok" if r.status == "ok" else f"[red]{r.status}[/red]"
        err_console.print(f"[dim]kprof compare: {v} {what} ({r.wall_s or 0:.1f} s)[/dim]")


def apply_cmd(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="The profiled training script. Arguments after `--` go to it.")],
    patch: Annotated[str, typer.Option("--patch", help="'all' or comma-separated suggestion ids from `kprof suggest`.")] = "all",
    strict: Annotated[bool, typer.Option("--strict", help="Fail if any patch fails verification "
                                         "(default: revert it, report, go on).")] = False,
    write: Annotated[Optional[Path], typer.Option("--write", help="Write the lines that keep these patches "
                                                  "(kprof.patch) to this file; '-' prints them.")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="The run whose plan to apply (default: the latest run "
                                               "of the script as written, not a patched or compiled one).")] = None,
    rules: Annotated[Optional[Path], typer.Option("--rules", help="A folder of extra rule files.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
    compare: Annotated[bool, typer.Option("--compare", help="Run the script as eager, with kprof's patches, under "
                                          "torch.compile and both, each in its own process and saved as a run, "
                                          "and compare them in one table with a verdict.")] = False,
    variants: Annotated[Optional[str], typer.Option("--variants", help="With --compare: which of "
                                                    "eager,kprof,compile,kprof+compile to run (default: all).")] = None,
    compile_mode: Annotated[Optional[str], typer.Option("--compile-mode", help="With --compare: torch.compile's mode "
                                                        "(default, reduce-overhead, max-autotune, "
                                                        "max-autotune-no-cudagraphs).")] = None,
    warmup: Annotated[Optional[int], typer.Option("--warmup", help="With --compare: untimed steps per variant "
                                                  "(default: the planned run's; at least 3 with compile).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="The most timed steps apply's ablation may take "
                                                 "(default: 21 blocks of every configuration); with --compare: "
                                                 "timed (and recorded) steps per variant (default: the planned "
                                                 "run's).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result (before/after, or with --compare the "
                                           "comparison) as one JSON document; the script's output goes to "
                                           "stderr.")] = False,
    prefer: Annotated[str, typer.Option("--prefer", help="'time': keep the patches that make the step faster; "
                                        "'memory': also those that cost time but save peak memory.")] = "time",
    keep_losers: Annotated[bool, typer.Option("--keep-losers", help="Install (and --write) every verified patch, "
                                              "also those the ablation dropped.")] = False,
    html: Annotated[Optional[str], typer.Option(
        "--html", metavar="[FILE]",
        help="Then write the before/after HTML report (the before run's roofline with an arrow per patch, "
             "savings predicted and measured) to FILE, default <after run>/report.html.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --write and --html replace an existing file (kept as "
                                        "FILE.bak, or the next free FILE.bak.N).")] = False,
) -> None:
    """Time each planned patch on and off in SCRIPT's own steps, keep only those that make the step
    faster, and compare before/after; with --compare, against torch.compile too."""
    from kprof.errors import KprofError

    if not compare:
        given = [o for o, v in (("--variants", variants), ("--compile-mode", compile_mode), ("--warmup", warmup))
                 if v is not None]
        if given:
            raise KprofError(f"{', '.join(given)} only go{'es' if len(given) == 1 else ''} with --compare "
                             f"(kprof apply SCRIPT --compare {' '.join(given)} ...)", exit_code=2)
    else:
        if write is not None:
            raise KprofError("--write goes with a plain `kprof apply --patch ...` run, not --compare; run that once "
                             "the comparison says the patches are worth keeping", exit_code=2)
        if keep_losers or prefer != "time":
            raise KprofError("--keep-losers and --prefer go with a plain `kprof apply` run, not --compare",
                             exit_code=2)
        if html is not None:
            raise KprofError("--html goes with a plain `kprof apply` run, not --compare; the variants are saved as "
                             "runs: `kprof report RUN --html` makes the page of one", exit_code=2)
        from kprof.patching.compare import compare as run_compare

        with stdout_to_stderr(json_out):
            res = run_compare(str(script), list(ctx.args), variants=variants, patch=patch, run=run, strict=strict,
                              rules_dir=str(rules) if rules else None, compile_mode=compile_mode or "default",
                              warmup=warmup, steps=steps, out_root=out, progress=_compare_progress)
        if json_out:
            print(json.dumps(res.to_dict() | {"saved": res.saved}, indent=1, allow_nan=False))
        else:
            render_compare(res)
        return

    if json_out and write is not None and str(write) == "-":
        raise KprofError("--write - prints the lines on stdout, where --json puts its document; "
                         "write them to a file instead (--write keep.py)", exit_code=2)
    from kprof.errors import INTERRUPTED
    from kprof.patching.apply import apply
    from kprof.store import check_write_target, write_keep_file

    if write is not None:  # checked before the run, not after it
        check_write_target(write, str(script), force=force)
    from kprof.cli import DEFAULT_HTML, write_html

    if html is not None and html != DEFAULT_HTML:  # the default is in the run apply is about to save
        check_write_target(Path(html), force=force, option="--html", example="report.html")
    try:
        with stdout_to_stderr(json_out):
            res = apply(str(script), list(ctx.args), patch=patch, run=run, strict=strict,
                        rules_dir=str(rules) if rules else None, out_root=out, steps=steps, prefer=prefer,
                        keep_losers=keep_losers)
    except KeyboardInterrupt:  # outside the script's runs (those say what they kept themselves)
        raise KprofError("interrupted during kprof apply, between its runs; nothing was written",
                         exit_code=INTERRUPTED) from None
    page = None
    if html is not None:
        try:
            page = write_html(store.load_run(res.after.path), html, force=force, root=out,
                              rules_dir=str(rules) if rules else None, checked=html != DEFAULT_HTML)
        except OSError as e:
            raise KprofError(f"--html {html}: {e.strerror or e}; the runs are saved: `kprof report {res.after.name} "
                             "--html FILE` writes the page") from None
    if json_out:
        # apply.json's document (ApplyResult.to_dict), where it is saved, the --write lines and the page
        print(json.dumps(res.to_dict() | {"apply": str(Path(res.after.path) / store.APPLY),
                                          "write_lines": res.write_lines}
                         | ({"html": str(page[0]), "html_missing": page[2]} if page else {}),
                         indent=1, allow_nan=False))
    else:
        render_apply(res)
    if page is not None:
        out_c = err_console if json_out else console
        for m in page[2]:
            err_console.print(Text(f"missing: {m}", style="yellow"))
        out_c.print(Text(f"report {page[0]}" + (f" (the old file kept as {page[1]})" if page[1] else "")))
    if res.watch is not None and res.watch["diverged"]:
        from kprof.errors import PATCH_FAILED

        raise KprofError(f"the patched run's loss diverged from the unpatched one at step {res.watch['step']} "
                         f"(kept: {', '.join(res.kept)}); nothing was written: leave these patches out, and report "
                         f"it with runs {res.before.name} and {res.after.name}", exit_code=PATCH_FAILED)
    if write is not None and not res.kept:
        (err_console if json_out else console).print(
            f"--write: no patch was kept, so nothing was written to {write} (--keep-losers writes them all)")
    elif write is not None:
        if str(write) == "-":
            print(res.write_lines, end="")
        else:
            try:
                bak = write_keep_file(write, res.write_lines)
            except OSError as e:
                raise KprofError(f"--write {write}: {e.strerror or e}; no file was changed; the lines to keep the "
                                 "patches are printed above", detail=res.write_lines) from None
            kept = f" (the old file is kept as {bak})" if bak else ""
            (err_console if json_out else console).print(
                Text(f"wrote {write}{kept}: add its lines to your script to keep the patches"))


def register(app: typer.Typer) -> None:
    """Add `suggest` and `apply` to kprof's typer app (called from kprof/cli/__init__.py)."""
    app.command("suggest")(suggest_cmd)
    app.command("apply", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})(apply_cmd)

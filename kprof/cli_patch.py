"""`kprof suggest` and `kprof apply`: thin typer commands over kprof.suggest and kprof.apply, and
their rendering. The lead registers them in kprof/cli.py with `cli_patch.register(app)`; a
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
from rich.table import Table

from kprof import store

console = Console()


def _f(v, fmt: str = "{:.2f}") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "?"
    return fmt.format(v)


def render_plan(plan: pd.DataFrame, run_name: str, plan_path: Path, out: Console | None = None,
                diagnoses: pd.DataFrame | None = None) -> None:
    out = out or console
    diag = diagnoses if diagnoses is not None else pd.DataFrame()
    if not len(plan) and not len(diag):
        out.print(f"kprof suggest: no pattern kprof can fix was found in run {run_name}.")
        return
    t = Table(title=f"suggestions for {run_name} (saved to {plan_path})", show_lines=True)
    for c in ("id", "where", "evidence", "change", "est. saving", "confidence", "how"):
        t.add_column(c, overflow="fold")
    for r in plan.to_dict("records"):
        where = r["where"] + (f"\n{r['module_class']}" if r["module_class"] else "") + (f"\n{r['source']}" if r["source"] else "")
        evidence = (f"{_f(r['ms/step'])} ms/step ({_f(r['% of step'], '{:.1f}')}% of step)\n"
                    f"{r['class']}, {_f(r['% of roofline'], '{:.0f}')}% of roofline")
        saving = f"{_f(r['saving ms/step'])} ms/step\n({_f(r['saving %'], '{:.1f}')}% of step)"
        t.add_row(r["id"], where, evidence, r["change"], saving, r["confidence"], r["how"])
    # Diagnoses (kprof.rules.diagnoses) after the kernel rules: script changes, not patches.
    for r in diag.to_dict("records"):
        where = r["where"] + (f"\n{r['source']}" if r["source"] else "")
        bound = "<= " if str(r["saving note"]).startswith("upper bound") else ""
        saving = (f"{bound}{_f(r['saving ms/step'])} ms/step\n({_f(r['saving %'], '{:.1f}')}% of step)"
                  if r["saving ms/step"] == r["saving ms/step"] else "?")
        t.add_row(r["id"], where, r["evidence"], r["change"], f"{saving}\n{r['saving note']}", r["confidence"], r["how"])
    if not len(plan):
        t.title = f"diagnoses for {run_name} (no kernel pattern found; saved to {plan_path})"
    out.print(t)
    if len(plan):
        out.print("estimated saving = measured time of the matched ops - the replacement's roofline time at "
                  "the same shapes (kernel spec FLOPs/bytes at this run's ceilings)", style="dim")


def suggest_cmd(
    run: Annotated[Optional[str], typer.Argument(help="Run directory or name (default: the latest).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    rules: Annotated[Optional[Path], typer.Option("--rules", help="A folder of extra rule files "
                                                   "(see examples/custom_rules/); they take precedence.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
) -> None:
    """Rank fixes for a profiled run (fused kernels, SDPA) with evidence and estimated savings,
    then the diagnoses no kernel fixes (host syncs, fp32 matmuls, unfused optimizer)."""
    from kprof.rules import all_rules
    from kprof.rules.diagnoses import diagnose
    from kprof.suggest import PLAN, plan_records, save_plan, suggest

    r = store.load_run(run, out)
    plan = suggest(r, all_rules(str(rules) if rules else None))
    diag = diagnose(r)
    path = save_plan(r, plan, diag)
    if json_out:
        print(json.dumps({"run": r.name, "plan": str(path), "suggestions": plan_records(plan),
                          "diagnoses": plan_records(diag)}, indent=1))
    else:
        render_plan(plan, r.name, Path(r.path) / PLAN, diagnoses=diag)


def render_apply(res, out: Console | None = None) -> None:
    out = out or console
    for rep in res.reports:
        t = Table(title="patches (verified on their first call against the original code)")
        for c in ("rule", "where", "status", "verification", "source"):
            t.add_column(c, overflow="fold")
        for rec in rep.records:
            style = {"verified": "green", "reverted": "red"}.get(rec.status, "yellow")
            t.add_row(rec.rule, rec.path or "<model>", f"[{style}]{rec.status}[/{style}]",
                      rec.verification.summary() if rec.verification else "not called", rec.source)
        out.print(t)
    t = Table(title=f"before ({res.before.name}) vs after ({res.after.name})")
    for c in ("metric", "before", "after", "change %"):
        t.add_column(c, justify="right" if c != "metric" else "left")
    for r in res.steps.to_dict("records"):
        t.add_row(r["metric"], _f(r["before"]), _f(r["after"]), _f(r["change %"], "{:+.1f}"))
    out.print(t)
    t = Table(title="per suggestion: saving (ms/step)")
    for c in ("id", "where", "predicted", "measured", "verified/patched"):
        t.add_column(c, overflow="fold")
    for r in res.suggestions.to_dict("records"):
        t.add_row(r["id"], r["where"] or "", _f(r["predicted saving ms/step"]), _f(r["measured saving ms/step"]),
                  f"{r['verified']}/{r['patched']}" + (f" ({r['failed']} reverted)" if r["failed"] else ""))
    out.print(t)
    t = Table(title="first losses")
    for c in ("step", "before", "after", "rel diff"):
        t.add_column(c, justify="right")
    for r in res.losses.to_dict("records"):
        t.add_row(str(r["step"]), f"{r['before']:.6f}", f"{r['after']:.6f}", f"{r['rel diff']:.2e}")
    out.print(t)
    if res.losses_agree is True:
        out.print(f"[green]first loss agrees within the patched dtype's tolerance (rtol {res.loss_tolerance:g})[/green]")
    elif res.losses_agree is False:
        out.print(f"[red]first loss differs beyond the tolerance (rtol {res.loss_tolerance:g}): is the script "
                  "seeded? If it is, report this with both run directories[/red]")
    else:
        out.print("[yellow]losses not compared (no losses recorded or no patch verified)[/yellow]")
    for n in res.notes:
        out.print(f"[yellow]note:[/yellow] {n}")


def apply_cmd(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="The profiled training script. Arguments after `--` go to it.")],
    patch: Annotated[str, typer.Option("--patch", help="'all' or comma-separated suggestion ids from `kprof suggest`.")] = "all",
    strict: Annotated[bool, typer.Option("--strict", help="Fail if any patch fails verification "
                                         "(default: revert it, report, go on).")] = False,
    write: Annotated[Optional[Path], typer.Option("--write", help="Write the lines that keep these patches "
                                                  "(kprof.patch) to this file; '-' prints them.")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="The run whose plan to apply (default: the latest).")] = None,
    rules: Annotated[Optional[Path], typer.Option("--rules", help="A folder of extra rule files.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Run store directory.")] = store.DEFAULT_ROOT,
) -> None:
    """Re-run SCRIPT with the planned patches, verified on first use, and compare before/after."""
    from kprof.apply import apply

    res = apply(str(script), list(ctx.args), patch=patch, run=run, strict=strict,
                rules_dir=str(rules) if rules else None, out_root=out)
    render_apply(res)
    if write is not None:
        if str(write) == "-":
            print(res.write_lines, end="")
        else:
            write.write_text(res.write_lines)
            console.print(f"wrote {write}: add its lines to your script to keep the patches")


def register(app: typer.Typer) -> None:
    """Add `suggest` and `apply` to kprof's typer app (called from kprof/cli.py)."""
    app.command("suggest")(suggest_cmd)
    app.command("apply", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})(apply_cmd)

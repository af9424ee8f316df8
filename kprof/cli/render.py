"""Terminal rendering of a saved run. Rendering only: every number comes from summary.json, which
kprof/analyze/profile.py fills from the analysis functions; nothing here computes a statistic."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

# --------------------------------------------------------------------------------------------
# Number formatting


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f  # NaN -> None


def fmt_ms(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "–"
    if f >= 100:
        return f"{f:,.0f}"
    if f >= 10:
        return f"{f:.1f}"
    if f >= 0.1:
        return f"{f:.2f}"
    return f"{f:.3f}"


def fmt_pct(v: Any, digits: int = 1) -> str:
    f = _num(v)
    return "–" if f is None else f"{f:.{digits}f}%"


def fmt_sig(v: Any) -> str:
    """Rates and intensities spanning many decades (CPU vs H200): ~3 significant digits."""
    f = _num(v)
    if f is None:
        return "–"
    a = abs(f)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{f:,.0f}"
    if a >= 1:
        return f"{f:.3g}"
    if a >= 1e-3:
        return f"{f:.2g}"
    return f"{f:.1e}"


def fmt_bytes(v: Any) -> str:
    f = _num(v)
    if f is None:
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if f >= scale:
            return f"{f / scale:.2f} {unit}"
    return f"{f:.0f} B"


def _first(row: dict, names: Sequence[str]) -> Any:
    for n in names:
        if n in row:
            return row[n]
    return None


# --------------------------------------------------------------------------------------------
# Sections


def _short_path(path: str) -> str:
    """A path relative to the current directory when it lies inside it (as the user typed it)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


def _is_cpu(summary: dict) -> bool:
    return (summary.get("device") or {}).get("type") == "cpu"


def header(summary: dict, run_path: Path | None) -> Panel:
    dev = summary.get("device") or {}
    ceil = summary.get("ceilings") or {}
    st = summary.get("step_time_ms") or {}
    pst = summary.get("profiled_step_time_ms") or {}
    status = summary.get("status", "?")
    style = {"completed": "green", "stopped": "green", "error": "red", "interrupted": "yellow"}.get(status, "white")

    short = summary.get("steps_recorded", 0) < (summary.get("steps") or 0)  # fewer steps than asked for
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column()
    g.add_row("script", Text(" ".join([_short_path(summary.get("script", "?")), *summary.get("argv", [])])))
    g.add_row("status", Text(f"{status}" + (f" (exit code {summary.get('exit_code')})" if status == "error" else ""), style=style)
              + Text(f"  {summary.get('status_note') or ''}", style="yellow" if short else "dim"))
    dev_line = f"{dev.get('name', '?')}"
    if dev.get("type") == "cuda":
        cap = str(dev.get("capability") or "?").replace(".", "")  # "9.0" -> sm_90
        dev_line += f"  (sm_{cap}, {dev.get('sm_count', '?')} SMs, {fmt_bytes(dev.get('total_memory'))})"
    elif dev.get("type") == "cpu":
        dev_line += f"  (CPU, {dev.get('cpu_count', '?')} cores)"
    g.add_row("device", dev_line)
    if ceil:
        line = Text(f"{fmt_sig(ceil.get('mem_bw_gbs'))} GB/s, "
                    + ", ".join(f"{k} {fmt_sig(v)} TFLOP/s" for k, v in _peaks(ceil))
                    + f", latency {fmt_sig(ceil.get('latency_us'))} us  ")
        style = {"measured": "green", "datasheet": "", "default": "yellow", "unknown": "red"}.get(ceil.get("kind"), "")
        g.add_row("ceilings", line + Text(f"({ceil.get('source', '?')})", style=style or "dim"))
    before = summary.get("steps_before_timing", summary.get("warmup", "?"))
    g.add_row("step", f"{summary.get('step_definition', '?')}: {summary.get('steps_recorded', 0)} recorded of "
              f"{summary.get('steps', '?')} requested, after {before} warmup + "
              f"{len(summary.get('step_times_ms') or [])} timed + "
              f"{summary.get('profiler_warmup_steps', 1)} profiler warm-up")
    if st:
        line = (f"{fmt_ms(st.get('median'))} ms median ± {fmt_ms(st.get('spread'))} "
                f"[dim]({st.get('spread_definition', 'spread')}, n={st.get('n', '?')}, unprofiled)[/dim]")
        if summary.get("tokens_per_s"):
            line += f"   {summary['tokens_per_s']:,.0f} tokens/s"
        g.add_row("step time", line)
    if summary.get("busy_pct") is not None:
        what = "CPU op time" if _is_cpu(summary) else "GPU busy"
        g.add_row("busy", f"{what} {fmt_pct(summary['busy_pct'])} of the step")
    if summary.get("peak_memory_bytes") is not None:
        g.add_row("memory", f"{fmt_bytes(summary['peak_memory_bytes'])} peak [dim]({summary.get('peak_memory_kind', '')})[/dim]")
    if summary.get("profiler_overhead_pct") is not None:
        g.add_row("overhead", f"profiled steps {fmt_ms(pst.get('median'))} ms median: "
                  f"{summary['profiler_overhead_pct']:+.0f}% vs unprofiled")
    if summary.get("coverage_pct") is not None:
        g.add_row("coverage", f"{fmt_pct(summary['coverage_pct'])} of op time has a known FLOP/byte cost")

    parts: list[Any] = [g]
    for w in [*(ceil.get("notes") or []), *(summary.get("warnings") or [])]:
        parts.append(Text(f"note: {w}", style="yellow"))
    if _is_cpu(summary):
        parts.append(Text(
            "CPU run: op times are CPU self times and the roofline uses CPU ceilings. "
            "Classes and percentages describe this CPU, not a GPU; profile on the GPU for GPU numbers.",
            style="yellow"))
    name = run_path.name if run_path else "unsaved run"
    return Panel(Group(*parts), title=f"[bold]kprof profile[/bold] · {name}", title_align="left")


def _peaks(ceil: dict) -> Iterable[tuple[str, float]]:
    peaks = ceil.get("peak_tflops") or {}
    for k in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        if peaks.get(k):
            yield k, peaks[k]


CLASS_STYLE = {"compute-bound": "green", "memory-bound": "cyan", "latency-bound": "magenta",
               "communication": "blue", "idle": "red", "unknown": "dim"}


def class_table(summary: dict) -> Table | None:
    rows = summary.get("class_breakdown") or []
    if not rows:
        return None
    t = Table(title="Time per class (per step)", title_justify="left")
    t.add_column("class")
    t.add_column("ms/step", justify="right")
    t.add_column("% of step", justify="right")
    for r in rows:
        cls = str(_first(r, ["class"]))
        t.add_row(Text(cls, style=CLASS_STYLE.get(cls, "")),
                  fmt_ms(_first(r, ["ms/step", "time/step (ms)", "time (ms/step)"])),
                  fmt_pct(_first(r, ["% of step"])))
    return t


# (header, candidate keys in a top-ops record, formatter)
TOP_COLUMNS: list[tuple[str, list[str], Callable[[Any], str]]] = [
    ("ms/step", ["ms/step", "time/step (ms)", "time (ms/step)"], fmt_ms),
    ("% step", ["% of step"], fmt_pct),
    ("TFLOP/s", ["TFLOP/s"], fmt_sig),
    ("GB/s", ["GB/s"], fmt_sig),
    ("FLOP/B", ["intensity (FLOP/B)"], fmt_sig),
    ("% roof", ["% of roofline"], fmt_pct),
]


def top_ops_table(summary: dict, width: int = 120) -> Table | None:
    rows = summary.get("top_ops") or []
    if not rows:
        return None
    # Group by module path, modules in order of their heaviest op (rows arrive sorted by time).
    # Each module gets a header row and its ops sit under it, which keeps the table narrow.
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get("module", "")), []).append(r)
    # No vertical rules: 11 columns must fit a 120-column terminal.
    t = Table(title=f"Top {len(rows)} ops by time, grouped by module (aten:: prefix omitted)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    # Only the shapes column gives way when the terminal is narrow (ellipsis); numbers never do.
    # Rich only shrinks wrapping columns, so widths are fixed here and shapes gets what is left.
    first = max([len("module / op")] + [len(_module_label(m)) for m in groups]
                + [len(_op_label(r.get("op"))) for r in rows])
    dtype_w = min(9, max([5] + [len(str(r.get("dtype", ""))) for r in rows]))
    num_w = [max(len(h), 7) for h, _, _ in TOP_COLUMNS]
    # Rich's fixed column width includes padding and separator: content + 2 (measured with rich
    # 13/14: a width of content + 1 cuts the last character); +2 for the box edges.
    fixed = (first + 2) + (dtype_w + 2) + sum(w + 2 for w in num_w) + (13 + 2) + 2
    t.add_column("module / op", no_wrap=True, width=first + 2)
    t.add_column("shapes", no_wrap=True, overflow="ellipsis", max_width=max(10, min(40, width - fixed)))
    t.add_column("dtype", no_wrap=True, overflow="ellipsis", width=dtype_w + 2)
    for (head, _, _), w in zip(TOP_COLUMNS, num_w):
        t.add_column(head, justify="right", no_wrap=True, width=w + 2)
    t.add_column("class", no_wrap=True, width=13 + 2)
    for module, group in groups.items():
        t.add_row(Text(_module_label(module), style="bold"))
        for i, r in enumerate(group):
            cells = [Text(_op_label(r.get("op"))), str(r.get("shapes", "")), str(r.get("dtype", ""))]
            cells += [f(v) if (v := _first(r, keys)) is not None else "–" for _, keys, f in TOP_COLUMNS]
            cls = str(r.get("class", ""))
            t.add_row(*cells, Text(cls, style=CLASS_STYLE.get(cls, "")), end_section=i == len(group) - 1)
    return t


def _op_label(op: Any) -> str:
    op = str(op or "?")
    return "  " + (op[len("aten::"):] if op.startswith("aten::") else op)


def _module_label(path: str) -> str:
    return "(root)" if path == "" else path


def syncs_table(summary: dict) -> Table | Text | Group:
    syncs = summary.get("syncs") or []
    if not syncs:
        return Text("Host syncs: none seen in the recorded steps.", style="green")
    t = Table(title="Host syncs in the recorded steps", title_justify="left")
    t.add_column("where", overflow="fold")
    t.add_column("kind")
    t.add_column("count", justify="right")
    t.add_column("code", overflow="fold")
    for s in syncs:
        where = f"{_short_path(s.get('file', '?'))}:{s.get('line', '?')}"
        if s.get("function"):
            where += f" ({s['function']})"
        t.add_row(where, str(s.get("kind", "?")), str(s.get("count", "")), str(s.get("code", "")).strip())
    if _is_cpu(summary):
        return Group(t, Text("CPU run: nothing waits here, but each of these would sync the host with "
                             "the GPU (the CPU stalls until the device catches up).", style="yellow"))
    return t


def files_section(run_path: Path | None, summary: dict) -> Text:
    if run_path is None:
        return Text("not saved (no step was recorded)", style="dim")
    files = summary.get("files") or {}
    lines = [f"run       {run_path}"]
    for key, label in (("summary", "summary"), ("ops", "ops"), ("trace", "trace")):
        if files.get(key):
            extra = "  (open in https://ui.perfetto.dev)" if key == "trace" else ""
            lines.append(f"{label:<9} {run_path / files[key]}{extra}")
    return Text("\n".join(lines))


def render(summary: dict, run_path: Path | None, console: Console) -> None:
    console.print(header(summary, run_path))
    for part in (class_table(summary), top_ops_table(summary, console.width)):
        if part is not None:
            console.print(part)
    if summary.get("steps_recorded", 0) == 0:
        console.print(Text("No step was recorded, so there are no op timings.", style="yellow"))
    console.print(syncs_table(summary))
    if summary.get("analysis_error"):
        console.print(Panel(Text(summary["analysis_error"].rstrip()), border_style="red", title_align="left",
                            title="kprof's analysis failed (a kprof bug): only the raw measurements were kept"))
    if summary.get("error"):
        console.print(Panel(Text(summary["error"].rstrip()), title="the script raised", border_style="red",
                            title_align="left"))
    console.print(files_section(run_path, summary))


def render_runs(rows: list[dict], console: Console) -> None:
    """`kprof runs`: one row per saved run (rows built by the CLI from summaries)."""
    t = Table(title="Saved runs (oldest first)", title_justify="left")
    for col, justify in (("run", "left"), ("status", "left"), ("device", "left"), ("step", "left"),
                         ("ms/step", "right"), ("steps", "right")):
        t.add_column(col, justify=justify)
    for r in rows:
        t.add_row(r["run"], r["status"], r["device"], r["step"], r["ms/step"], r["steps"])
    console.print(t)


def render_ceilings(c: dict, cache_path: str | None, console: Console) -> None:
    """`kprof calibrate`: the measured ceilings (a ceilings.Ceilings as a dict) and where they went."""
    g = Table.grid(padding=(0, 2))
    g.add_column(style="bold")
    g.add_column(justify="right")
    g.add_column()
    g.add_row("memory bandwidth", fmt_sig(c.get("mem_bw_gbs")), "GB/s (copy, read + write)")
    for k, v in _peaks(c):
        g.add_row(f"{k} peak", fmt_sig(v), "TFLOP/s")
    g.add_row("latency threshold", fmt_sig(c.get("latency_us")), "us (ops faster than this per launch are latency-bound)")
    parts: list[Any] = [g, Text(f"source: {c.get('source', '?')}", style="dim")]
    parts += [Text(f"note: {n}", style="dim") for n in c.get("notes") or []]
    if cache_path:
        parts.append(Text(f"cached in {cache_path}; `kprof profile` uses it for this device from now on"))
    console.print(Panel(Group(*parts), title=f"[bold]kprof calibrate[/bold] · {c.get('device', '?')}", title_align="left"))

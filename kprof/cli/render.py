"""Terminal rendering of a saved run. Rendering only: every number comes from summary.json, which
kprof/analyze/profile.py fills from the analysis functions; nothing here computes a statistic."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
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
# Tables that fit the terminal: a table when every column gets at least its longest word (and
# every number its whole width), after dropping the columns marked droppable; else one block per
# row ("stacked records"). Rich alone would fold cells mid-word or cut numbers to "…" instead.

@dataclass(frozen=True)
class Col:
    """A column of `fit`. `number` cells and their header are never wrapped (the column is as wide
    as its widest cell); the others wrap at spaces, and get at least `min_width`. Columns with drop > 0 are left out, highest first, when the table does not
    fit."""
    name: str
    justify: str = "left"
    number: bool = False
    drop: int = 0
    min_width: int = 0
    unit: str | None = None  # after a number in a one-line record (`stacked(inline=True)`); None: name


def as_text(cell: Any) -> Text:
    """A cell as rich Text: str cells are rich markup (kprof's own strings); wrap data that may
    hold brackets (code, shapes) in Text before passing it."""
    if isinstance(cell, Text):
        return cell
    return Text.from_markup(str(cell)) if cell is not None else Text("")


def _longest_word(t: Text) -> int:
    return max([cell_len(w) for line in t.plain.splitlines() for w in line.split()] or [0])


def _longest_line(t: Text) -> int:
    return max([cell_len(line) for line in t.plain.splitlines()] or [0])


def column_widths(cols: Sequence[Col], rows: Sequence[Sequence[Text]], width: int,
                  overhead: Callable[[int], int]) -> tuple[list[int], list[int]] | None:
    """(indices of the columns kept, their content widths) so that the table is at most `width`
    wide with no word split, or None when even the columns that can't be dropped don't fit.
    `overhead(n)`: the borders and padding of a table of n columns."""
    lo, hi = [], []
    for i, c in enumerate(cols):
        head = Text(c.name)
        cells = [r[i] for r in rows]
        longest = max([_longest_line(t) for t in cells] or [0])
        lo.append(max([c.min_width, _longest_line(head) if c.number else _longest_word(head)]
                      + [longest if c.number else _longest_word(t) for t in cells]))
        hi.append(max([_longest_line(head), longest, lo[-1]]))
    def fits(keep: list[int]) -> bool:
        return sum(lo[j] for j in keep) + overhead(len(keep)) <= width

    keep = list(range(len(cols)))
    dropped = []
    for i in sorted((i for i, c in enumerate(cols) if c.drop > 0), key=lambda i: -cols[i].drop):
        if fits(keep):
            break
        keep.remove(i)
        dropped.append(i)
    # Then take back, most valuable first, any dropped column that fits in what the later drops freed.
    for i in reversed(dropped[:-1]):
        if fits(sorted(keep + [i])):
            keep = sorted(keep + [i])
    spare = width - overhead(len(keep)) - sum(lo[j] for j in keep)
    if spare < 0:
        return None
    widths = [lo[j] for j in keep]
    # The spare columns go to the wrapping columns in proportion to what they'd need unwrapped.
    want = [hi[j] - lo[j] for j in keep]
    total = sum(want)
    if total:
        for k, w in enumerate(want):
            widths[k] += min(w, spare * w // total)
    return keep, widths


def _overhead(make_table: Callable[[], Table]) -> Callable[[int], int]:
    """overhead(n): the columns a table from `make_table` spends on borders, separators and
    padding with n columns, measured by rendering one (it depends on the box, the padding and
    pad_edge, and rich's conventions, e.g. SIMPLE_HEAD's separators are spaces)."""
    import io

    def overhead(n: int) -> int:
        t = make_table()
        for _ in range(n):
            t.add_column(width=1)
        t.add_row(*["x"] * n)
        c = Console(file=io.StringIO(), width=10_000, record=True, color_system=None)
        c.print(t)
        return max(cell_len(line) for line in c.export_text().splitlines()) - n

    return overhead


def _boxed() -> Table:
    return Table(show_header=False)


_boxed_overhead = _overhead(_boxed)


def stacked(cols: Sequence[Col], rows: Sequence[Sequence[Text]], head: Sequence[int] = (0,),
            inline: bool = False) -> Group:
    """One block per row: the `head` cells on a bold title line, then "key: value" lines, values
    wrapped at spaces under their own indent (a word longer than the terminal still folds).
    inline: the cells on one wrapped line instead, "value key" for numbers ("46.0 ms/step")."""
    blocks: list[RenderableType] = []
    for r in rows:
        title = Text("  ").join(r[i] for i in head if r[i].plain)
        title.stylize("bold")
        if inline:
            cells = [Text.assemble(r[i], " ", (c.name if c.unit is None else c.unit, "dim"))
                     if c.number and c.unit != "" else r[i]
                     for i, c in enumerate(cols) if i not in head and r[i].plain.strip()]
            blocks += [title, Padding(Text(", ").join(cells), (0, 0, 0, 4))]
            continue
        g = Table.grid(padding=(0, 1))
        g.add_column(no_wrap=True, style="dim")
        g.add_column(overflow="fold")
        for i, c in enumerate(cols):
            if i not in head and r[i].plain.strip():
                g.add_row(f"  {c.name}:", r[i])
        blocks += [title, g, Text("")]
    return Group(*(blocks if inline else blocks[:-1]))


def fit(cols: Sequence[Col], rows: Sequence[Sequence[Any]], width: int, title: str | Text | None = None,
        head: Sequence[int] = (0,), show_lines: bool = False) -> Group:
    """The table of `cols` x `rows` as wide as fits `width` (see `column_widths`), stacked
    records (`stacked`, titled by the `head` columns) when it can't fit. The title is a line of
    its own above it, wrapped to the terminal rather than to the table."""
    cells = [[as_text(c) for c in r] for r in rows]
    parts: list[RenderableType] = []
    if title is not None:
        parts.append(title if isinstance(title, Text) else Text(title, style="italic"))
    fitted = column_widths(cols, cells, width, _boxed_overhead)
    if fitted is None:
        parts.append(stacked(cols, cells, head))
        return Group(*parts)
    keep, widths = fitted
    t = Table(show_lines=show_lines)
    for j, w in zip(keep, widths):
        c = cols[j]
        t.add_column(c.name, justify=c.justify, width=w, overflow="fold")
    for r in cells:
        t.add_row(*(r[j] for j in keep))
    parts.append(t)
    return Group(*parts)


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


# (header, candidate keys in a top-ops record, formatter, drop priority and unit: see Col)
TOP_COLUMNS: list[tuple[str, list[str], Callable[[Any], str], int, str | None]] = [
    ("ms/step", ["ms/step", "time/step (ms)", "time (ms/step)"], fmt_ms, 0, None),
    ("% step", ["% of step"], fmt_pct, 0, "of step"),
    ("TFLOP/s", ["TFLOP/s"], fmt_sig, 3, None),
    ("GB/s", ["GB/s"], fmt_sig, 2, None),
    ("FLOP/B", ["intensity (FLOP/B)"], fmt_sig, 4, None),
    ("% roof", ["% of roofline"], fmt_pct, 0, "of roofline"),
]


def top_ops_table(summary: dict, width: int = 120) -> Group | None:
    """The heaviest ops, grouped by module path (modules in order of their heaviest op; rows
    arrive sorted by time): the module on a line of its own, its ops under it, so the table is
    only as wide as the op names. Narrow terminals lose dtype, then FLOP/B, TFLOP/s, GB/s and
    the shapes, never a number's digits; below that, one block per op."""
    rows = summary.get("top_ops") or []
    if not rows:
        return None
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r.get("module", "")), []).append(r)
    # A shapes cell wraps between tensors, not inside one: "[1024, 128]," is its narrowest.
    one_shape = max([len(m) for r in rows for m in re.findall(r"\[[^\]]*\],?", str(r.get("shapes", "")))] or [0])
    cols = [Col("op", number=True), Col("shapes", drop=1, min_width=one_shape), Col("dtype", number=True, drop=5),
            *[Col(h, justify="right", number=True, drop=d, unit=u) for h, _, _, d, u in TOP_COLUMNS],
            Col("class", number=True, unit="")]
    cells: dict[str, list[list[Text]]] = {}
    for module, group in groups.items():
        cells[module] = []
        for r in group:
            nums = [f(v) if (v := _first(r, keys)) is not None else "–" for _, keys, f, _, _ in TOP_COLUMNS]
            cls = str(r.get("class", ""))
            cells[module].append([Text(_op_label(r.get("op"))), Text(str(r.get("shapes", ""))),
                                  Text(str(r.get("dtype", ""))), *map(Text, nums), Text(cls, style=CLASS_STYLE.get(cls, ""))])
    title = Text(f"Top {len(rows)} ops by time, grouped by module (aten:: prefix omitted)", style="italic")

    def table(show_header: bool = False) -> Table:
        # One table per module, all with the same fixed widths so their columns line up.
        return Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), show_header=show_header,
                     show_edge=False)

    fitted = column_widths(cols, [c for g in cells.values() for c in g], width, _overhead(table))
    parts: list[RenderableType] = [title]
    if fitted is None:
        # One line of title (op, shapes, dtype) and one of numbers per op: the ops stay scannable.
        for module, group in cells.items():
            parts += [Text(_module_label(module), style="bold"), stacked(cols, group, head=(0, 1, 2), inline=True)]
        return Group(*parts)
    keep, widths = fitted

    def fixed(show_header: bool) -> Table:
        t = table(show_header)
        for j, w in zip(keep, widths):
            t.add_column(cols[j].name, justify=cols[j].justify, width=w, overflow="fold")
        return t

    parts.append(fixed(show_header=True))
    for module, group in cells.items():
        t = fixed(show_header=False)
        for r in group:
            t.add_row(*(r[j] for j in keep))
        parts += [Text(_module_label(module), style="bold"), t]
    return Group(*parts)


def _op_label(op: Any) -> str:
    op = str(op or "?")
    return "  " + (op[len("aten::"):] if op.startswith("aten::") else op)


def _module_label(path: str) -> str:
    return "(root)" if path == "" else path


def syncs_table(summary: dict, width: int = 120) -> RenderableType:
    syncs = summary.get("syncs") or []
    if not syncs:
        return Text("Host syncs: none seen in the recorded steps.", style="green")
    rows = []
    for s in syncs:
        where = f"{_short_path(s.get('file', '?'))}:{s.get('line', '?')}"
        if s.get("function"):
            where += f" ({s['function']})"
        rows.append([Text(where), Text(str(s.get("kind", "?"))), Text(str(s.get("count", ""))),
                     Text(str(s.get("code", "")).strip())])
    cols = [Col("where"), Col("kind"), Col("count", justify="right", number=True), Col("code")]
    t = fit(cols, rows, width, title="Host syncs in the recorded steps")
    if _is_cpu(summary):
        return Group(t, Text("CPU run: nothing waits here, but each of these would sync the host with "
                             "the GPU (the CPU stalls until the device catches up).", style="yellow"))
    return t


def ranks_table(summary: dict, width: int = 120) -> RenderableType | None:
    """A multi-process run: one row per rank, then the skew, the slowest rank and the straggler."""
    d = summary.get("distributed")
    if not d:
        return None
    cols = [Col("rank", justify="right", number=True), Col("step ms", justify="right", number=True),
            Col("comm ms/step", justify="right", number=True), Col("exposed", justify="right", number=True),
            Col("loader ms", justify="right", number=True, drop=2), Col("busy %", justify="right", number=True, drop=1),
            Col("status", drop=3)]
    rows = [[str(r["rank"]), fmt_ms(r.get("step ms")), fmt_ms(r.get("comm ms/step")),
             fmt_ms(r.get("exposed comm ms/step")), fmt_ms(r.get("loader ms/step")), fmt_pct(r.get("busy %"), 0),
             str(r.get("status") or "")] for r in d.get("ranks") or []]
    lines = []
    if d.get("skew %") is not None:
        lines.append(f"step time skew {fmt_pct(d['skew %'], 0)} (max - min over the median); slowest rank "
                     f"{d.get('slowest rank')}, on which apply's before/after is judged")
    st = d.get("straggler")
    if st:
        lines.append(f"straggler: rank {st['rank']}; the others wait {fmt_ms(st['others wait ms/step'])} ms/step "
                     "longer in collectives")
    if d.get("missing_ranks"):
        lines.append(f"no run from rank(s) {', '.join(map(str, d['missing_ranks']))}")
    title = f"{d.get('world_size')} ranks (unprofiled step medians; comm and exposed from the recorded steps)"
    return Group(fit(cols, rows, width, title=title), *(Text(ln) for ln in lines))


def files_section(run_path: Path | None, summary: dict) -> RenderableType:
    if run_path is None:
        return Text("not saved (no step was recorded)", style="dim")
    files = summary.get("files") or {}
    # A grid, so that a path longer than the terminal wraps under itself, not under the labels.
    g = Table.grid(padding=(0, 1))
    g.add_column(no_wrap=True)
    g.add_column(overflow="fold")
    g.add_row("run", Text(str(run_path)))
    for key, label in (("summary", "summary"), ("ops", "ops"), ("trace", "trace"), ("ranks", "ranks")):
        if files.get(key):
            extra = " (open in https://ui.perfetto.dev)" if key == "trace" else ""
            g.add_row(label, Text(f"{run_path / files[key]}{extra}"))
    return g


def render(summary: dict, run_path: Path | None, console: Console) -> None:
    console.print(header(summary, run_path))
    for part in (ranks_table(summary, console.width), class_table(summary), top_ops_table(summary, console.width)):
        if part is not None:
            console.print(part)
    if summary.get("steps_recorded", 0) == 0:
        console.print(Text("No step was recorded, so there are no op timings.", style="yellow"))
    console.print(syncs_table(summary, console.width))
    if summary.get("analysis_error"):
        console.print(Panel(Text(summary["analysis_error"].rstrip()), border_style="red", title_align="left",
                            title="kprof's analysis failed (a kprof bug): only the raw measurements were kept"))
    if summary.get("error"):
        console.print(Panel(Text(summary["error"].rstrip()), title="the script raised", border_style="red",
                            title_align="left"))
    console.print(files_section(run_path, summary))


def render_runs(rows: list[dict], console: Console) -> None:
    """`kprof runs`: one row per saved run (rows built by the CLI from summaries)."""
    cols = [Col("run", number=True), Col("status", number=True), Col("device", drop=1), Col("step", drop=2),
            Col("ms/step", justify="right", number=True), Col("steps", justify="right", number=True)]
    cells = [[Text(r["run"]), r["status"], Text(r["device"]), Text(r["step"]), r["ms/step"], r["steps"]]
             for r in rows]
    console.print(fit(cols, cells, console.width, title="Saved runs (oldest first)"))


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


_SPARK = " ▁▂▃▄▅▆▇█"


def memory_section(summary: dict, width: int = 80) -> RenderableType:
    """`kprof report --memory`: the peak's breakdown, the activations saved per module and the
    allocated-memory timeline, from summary["memory"] (kprof/analyze/memory.py)."""
    m = summary.get("memory") or {}
    if m.get("error"):
        return Text(m["error"], style="yellow")
    if "categories" not in m:
        return Text("No memory record in this run (profiled before kprof recorded memory, or the "
                    "script ended before the shapes step); profile it again.", style="yellow")
    peak = m["peak_bytes"]
    t = Table(title=f"Memory at the step's peak: {fmt_bytes(peak)}, {m.get('peak_moment', '?')}",
              title_justify="left")
    t.add_column("kind")
    t.add_column("bytes", justify="right")
    t.add_column("% of peak", justify="right")
    for k, v in m["categories"].items():
        t.add_row(k, fmt_bytes(v), fmt_pct(100 * v / peak if peak else None))
    if m.get("fragmentation_bytes") is not None:
        t.add_row("fragmentation", fmt_bytes(m["fragmentation_bytes"]), "(reserved - allocated)")
    notes = [f"source: {m.get('source', '?')}"]
    if m.get("max_allocated"):
        notes.append(f"max_memory_allocated {fmt_bytes(m['max_allocated'])}; categories sum "
                     f"{fmt_bytes(m.get('categories_sum'))}")
    a = Table(title="Activations saved for backward, by module", title_justify="left")
    a.add_column("module", overflow="fold")
    a.add_column("bytes", justify="right")
    a.add_column("blocks", justify="right")
    for r in (m.get("activations_saved") or [])[:10]:
        a.add_row(_module_label(r["module"]) if r["module"] else "", fmt_bytes(r["bytes"]), str(r["blocks"]))
    tl = m.get("timeline") or []
    parts: list[RenderableType] = [t, Text("\n".join(notes), style="dim"), a]
    if tl:
        cols = max(10, min(width - 2, 78))
        vals = [p["allocated"] for p in tl]
        hi, lo = max(vals), min(vals)
        step = max(1, math.ceil(len(vals) / cols))
        binned = [max(vals[i:i + step]) for i in range(0, len(vals), step)]
        spark = "".join(_SPARK[round((v - lo) / (hi - lo) * 8) if hi > lo else 8] for v in binned)
        ph = m.get("phases_ms") or {}
        marks = ", ".join(f"{k.replace('_', ' ')} {v:.1f} ms" for k, v in ph.items() if v is not None)
        parts += [Text(f"Allocated over the step ({fmt_bytes(lo)} to {fmt_bytes(hi)}; peak at "
                       f"{m.get('peak_ms') or 0:.1f} ms)"), Text(spark), Text(marks, style="dim")]
    return Group(*parts)
# --------------------------------------------------------------------------------------------
# `kprof report --kernels` and `kprof profile --ncu`


def _class_label(cls: str, under: bool) -> Text:
    # efficiency.label's wording, kept here so rendering imports nothing from analyze
    return Text(f"{cls}, under-used" if under else cls, style=CLASS_STYLE.get(cls, ""))


def _short_kernel(name: str, most: int = 60) -> str:
    """A kernel name without "void " and cut after `most` characters: demangled names run to
    hundreds of characters of template arguments; kernels.parquet keeps the whole name."""
    s = re.sub(r"^void\s+", "", str(name))
    return s if len(s) <= most else s[: most - 1] + "…"


def kernels_table(summary: dict, width: int = 120) -> RenderableType:
    """The top kernels (summary["top_kernels"]): one row per kernel and op, with the modules that
    ran it, its time, % of roofline and class (with the under-used qualifier and its causes)."""
    rows = summary.get("top_kernels")
    if rows is None:
        if _is_cpu(summary):
            return Text("CPU run: no device kernels; the per-op table is the report's top ops.", style="yellow")
        return Text("This run has no per-kernel table (profiled before kprof recorded one); "
                    "profile the script again.", style="yellow")
    if not rows:
        return Text("No kernels in the recorded steps.", style="yellow")
    cols = [Col("kernel", min_width=20), Col("op / modules", drop=1), Col("ms/step", justify="right", number=True),
            Col("% step", justify="right", number=True, drop=2, unit="of step"),
            Col("GB/s", justify="right", number=True, drop=3),
            Col("% roof", justify="right", number=True, unit="of roofline"),
            Col("class (causes)", min_width=13)]
    cells = []
    for r in rows:
        cls = str(r.get("class", ""))
        under = bool(r.get("under-used"))
        label = _class_label(cls, under)
        if r.get("causes"):
            label.append(f" ({r['causes']})", style="yellow")
        cells.append([Text(_short_kernel(r.get("kernel", ""), 36)),
                      Text(f"{_op_label(r.get('op')).strip()} in {r.get('modules') or '?'}"),
                      fmt_ms(r.get("time/step (ms)")), fmt_pct(r.get("% of step")), fmt_sig(r.get("GB/s")),
                      fmt_pct(r.get("% of roofline")), label])
    thr = summary.get("under_used_threshold") or {}
    title = Text(f"Top {len(rows)} kernels by time (every kernel of kernels.parquet, one row per kernel and op)",
                 style="italic")
    note = Text(f"under-used: below {100 * float(thr.get('value', 0.5)):.0f}% of roofline on its bound"
                + ("" if thr.get("fitted") else " (threshold not yet fitted on hardware counters)")
                + "; FLOPs and bytes of an op split across its kernels by time", style="dim")
    return Group(fit(cols, cells, width, title=title, head=(0,)), note)


def ncu_table(doc: dict, width: int = 120) -> RenderableType:
    """kprof's class beside Nsight Compute's counters (ncu.json), with the agreement."""
    rows = doc.get("kernels") or []
    cols = [Col("kernel", min_width=20), Col("us/step", justify="right", number=True, drop=3),
            Col("kprof", min_width=13), Col("DRAM", justify="right", number=True),
            Col("tensor", justify="right", number=True, drop=2), Col("FMA/ALU", justify="right", number=True, drop=2),
            Col("occ.", justify="right", number=True, drop=4), Col("ncu", number=True), Col("agree", number=True)]
    cells = []
    for r in rows:
        pipes = [v for v in (_num(r.get("FMA %")), _num(r.get("ALU %"))) if v is not None]
        pipe = max(pipes) if pipes else None
        agree = r.get("agree")
        cells.append([Text(_short_kernel(r.get("kernel", ""), 36)), fmt_sig(r.get("time/step (us)")),
                      _class_label(str(r.get("class", "")), bool(r.get("under-used"))),
                      fmt_pct(r.get("DRAM %"), 0), fmt_pct(r.get("tensor %"), 0), fmt_pct(pipe, 0),
                      fmt_pct(r.get("occupancy %"), 0), Text(str(r.get("ncu class") or "–")),
                      Text("–" if agree is None else ("yes" if agree else "NO"),
                           style="" if agree is None or agree else "bold red")])
    a = doc.get("agreement") or {}
    summary_line = Text(f"agreement: {a.get('agree', 0)} of {a.get('scored', 0)} scored kernels "
                        f"({fmt_pct(a.get('by count (%)'))} by count, {fmt_pct(a.get('by time (%)'))} by time); "
                        f"{a.get('not scored', 0)} not scored (communication, unknown cost, or no counters)")
    rule = Text("ncu class: memory-bound if DRAM >= 50% and above the compute pipe; compute-bound if "
                "the tensor pipe (FMA/ALU for non-tensor kernels) >= 50% and above DRAM; else neither, "
                "which kprof's latency-bound and under-used mean", style="dim")
    return Group(fit(cols, cells, width, title=Text("kprof's class vs Nsight Compute", style="italic")),
                 summary_line, rule)

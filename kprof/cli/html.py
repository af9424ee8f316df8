"""`kprof report --html`: one self-contained HTML file from kprof.analyze.report's data.

Nothing is fetched when the file is opened (it must work offline and be mailable): the CSS and
the script are inline, the data is embedded as JSON (<script type="application/json">), and the
roofline is an SVG drawn here, in Python. Drawing it server-side keeps the file small (no
charting library), lets a test count its points with html.parser, and leaves the picture
intact with scripts off; the inline script only adds the hover tooltip.
"""

from __future__ import annotations

import json
import math
from html import escape
from typing import Any

from kprof import store

# The terminal's class colours (render.CLASS_STYLE), as CSS colours.
CLASS_COLOUR = {"compute-bound": "#2e9e44", "memory-bound": "#1f8fb4", "latency-bound": "#b03fb0",
                "communication": "#3454c4", "idle": "#c43c3c", "unknown": "#888888"}

W, H = 700, 460  # the roofline's SVG size (px)
ML, MR, MT, MB = 64, 16, 16, 48  # its margins: room for the axis labels

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px 3px 0;text-align:left;vertical-align:top}
th{border-bottom:1px solid #ccc}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.hdr td:first-child{font-weight:600;padding-right:16px}
.banner{background:#fff4d6;border:1px solid #e6c45c;padding:8px 12px;margin:10px 0;border-radius:4px}
.missing{background:#fde8e8;border:1px solid #e39a9a;padding:8px 12px;margin:10px 0;border-radius:4px}
code{font:12px ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap}
svg text{font:11px system-ui,sans-serif;fill:#444}.grid{stroke:#eee}.axis{stroke:#888}
.ceil{stroke:#222;stroke-width:1.5;fill:none}.pt{fill-opacity:.65;stroke:#fff;stroke-width:.5}
.pt:hover{fill-opacity:1;stroke:#000}
#tip{position:fixed;display:none;background:#fff;border:1px solid #999;padding:6px 8px;font-size:12px;
pointer-events:none;box-shadow:0 2px 6px rgba(0,0,0,.2);max-width:420px}
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:10px;height:10px;
border-radius:5px;margin-right:4px;vertical-align:middle}
"""

# Reads the embedded data by each point's data-i; writes text only (textContent), never HTML,
# since op names and shapes come from the user's model.
JS = """
(function(){
  var data=JSON.parse(document.getElementById('kprof-data').textContent);
  var tip=document.getElementById('tip');
  function f(v,d){return v===null||v===undefined?'?':Number(v).toPrecision(d||3);}
  document.querySelectorAll('circle.pt').forEach(function(c){
    c.addEventListener('mousemove',function(e){
      var p=data.points[+c.getAttribute('data-i')];
      tip.textContent=[p.op+'  ('+p['class']+')','module: '+(p.module||'(root)'),'shapes: '+(p.shapes||'?'),
        f(p.ms_per_step)+' ms/step, '+(p.pct_step===null?'?':p.pct_step.toFixed(1))+'% of step',
        f(p.intensity)+' FLOP/B, '+f(p.tflops)+' TFLOP/s, '+f(p.gbs)+' GB/s',
        (p.pct_roofline===null?'?':p.pct_roofline.toFixed(0))+'% of roofline'].join('\\n');
      tip.style.whiteSpace='pre';tip.style.display='block';
      tip.style.left=(e.clientX+14)+'px';tip.style.top=(e.clientY+14)+'px';
    });
    c.addEventListener('mouseleave',function(){tip.style.display='none';});
  });
  // Reached only if nothing above threw: the browser test reads it from the rendered DOM.
  document.body.setAttribute('data-kprof-ready',String(document.querySelectorAll('circle.pt').length));
})();
"""


def _e(v: Any) -> str:
    return escape("" if v is None else str(v))


def _sig(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    v = float(v)
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _pct(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{float(v):.1f}%"


def _first(r: dict, keys: list[str]) -> Any:
    for k in keys:
        if r.get(k) is not None:
            return r[k]
    return None


def _decades(lo: float, hi: float) -> tuple[float, float]:
    """Whole decades around [lo, hi], so the ticks fall on 10^k."""
    return 10.0 ** math.floor(math.log10(lo)), 10.0 ** math.ceil(math.log10(hi))


def roofline_svg(data: dict) -> str:
    """The log-log roofline: x intensity (FLOP/B), y achieved TFLOP/s; the device's memory slope
    and compute peaks; one circle per placed point, area by time, colour by class."""
    pts = [(i, p) for i, p in enumerate(data["points"]) if p["placed"]]
    c = data["ceilings"]
    bw, peaks = c["mem_bw_gbs"], c["peak_tflops"]
    xs = [p["intensity"] for _, p in pts]
    ys = [p["tflops"] for _, p in pts]
    top = max(peaks.values()) if peaks else None
    if bw and top:
        xs.append(top * 1e3 / bw)  # the highest ridge point stays in view
        ys.append(top)
    if not xs:
        return ""
    x0, x1 = _decades(min(xs) / 2, max(xs) * 2)
    y0, y1 = _decades(min(ys) / 2, max(ys) * 2)
    pw, ph = W - ML - MR, H - MT - MB

    def sx(x: float) -> float:
        return ML + pw * (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))

    def sy(y: float) -> float:
        return MT + ph * (1 - (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0)))

    out = [f'<svg id="roofline" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="roofline">']
    for k in range(round(math.log10(x0)), round(math.log10(x1)) + 1):
        x = sx(10.0 ** k)
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{MT}" x2="{x:.1f}" y2="{MT + ph}"/>'
                   f'<text x="{x:.1f}" y="{MT + ph + 16}" text-anchor="middle">1e{k}</text>')
    for k in range(round(math.log10(y0)), round(math.log10(y1)) + 1):
        y = sy(10.0 ** k)
        out.append(f'<line class="grid" x1="{ML}" y1="{y:.1f}" x2="{ML + pw}" y2="{y:.1f}"/>'
                   f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end">1e{k}</text>')
    out.append(f'<rect class="axis" x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none"/>'
               f'<text x="{ML + pw / 2}" y="{H - 8}" text-anchor="middle">arithmetic intensity (FLOP/B)</text>'
               f'<text transform="translate(14 {MT + ph / 2}) rotate(-90)" text-anchor="middle">'
               f'achieved TFLOP/s</text>')
    # The ceilings, clipped to the plot: min(bw x I, peak) per dtype peak.
    out.append(f'<clipPath id="plot"><rect x="{ML}" y="{MT}" width="{pw}" height="{ph}"/></clipPath>')
    # Dtypes with the same peak share one line and one label (a CPU's fp32 and bf16, say).
    same: dict[float, list[str]] = {}
    for name, peak in peaks.items():
        same.setdefault(peak, []).append(name)
    for peak, names in sorted(same.items()):
        name = ", ".join(names)
        if bw:
            ridge = peak * 1e3 / bw
            path = (f"M{sx(x0):.1f},{sy(max(bw * x0 / 1e3, y0 / 10)):.1f} L{sx(ridge):.1f},{sy(peak):.1f} "
                    f"L{sx(x1):.1f},{sy(peak):.1f}")
        else:
            path = f"M{sx(x0):.1f},{sy(peak):.1f} L{sx(x1):.1f},{sy(peak):.1f}"
        out.append(f'<path class="ceil" clip-path="url(#plot)" d="{path}"/>'
                   f'<text x="{ML + pw - 4}" y="{sy(peak) - 5:.1f}" text-anchor="end">{_e(name)} {_sig(peak)} TFLOP/s</text>')
    if bw:
        out.append(f'<text x="{ML + 4}" y="{MT + ph - 6}">memory {_sig(bw)} GB/s</text>')
    tmax = max([p["ms_per_step"] for _, p in pts] or [1.0]) or 1.0
    # Heaviest first, so the small points are drawn last and stay hoverable on top.
    for i, p in pts:
        r = 3 + 13 * math.sqrt(max(p["ms_per_step"], 0.0) / tmax)
        colour = CLASS_COLOUR.get(p["class"], "#888")
        out.append(f'<circle class="pt" data-i="{i}" cx="{sx(p["intensity"]):.1f}" cy="{sy(p["tflops"]):.1f}" '
                   f'r="{r:.1f}" fill="{colour}"><title>{_e(p["op"])} in {_e(p["module"] or "(root)")}: '
                   f'{_sig(p["ms_per_step"])} ms/step, {_e(p["class"])}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """A table from already-escaped cells; columns in `numeric` are right-aligned."""
    th = "".join(f'<th class="n">{h}</th>' if j in numeric else f"<th>{h}</th>" for j, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if j in numeric else f"<td>{c}</td>"
                                    for j, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _header(d: dict) -> str:
    h = d["header"]
    rows = [("run", d["run"]), ("script", h["script"]),
            ("status", " · ".join(x for x in (h["status"] or "?", h["status_note"]) if x)),
            ("device", f"{h['device'] or '?'} ({h['device_type'] or '?'})"),
            ("step", h["step_definition"] or "?")]
    if h["step_ms"] is not None:
        line = f"{_sig(h['step_ms'])} ms median ± {_sig(h['step_spread_ms'])} (unprofiled)"
        if h["tokens_per_s"]:
            line += f", {h['tokens_per_s']:,.0f} tokens/s"
        rows.append(("step time", line))
    if h["busy_pct"] is not None:
        rows.append(("busy", f"{'CPU op time' if d['cpu'] else 'GPU busy'} {_pct(h['busy_pct'])} of the step"))
    if h["coverage_pct"] is not None:
        rows.append(("coverage", f"{_pct(h['coverage_pct'])} of op time has a known FLOP/byte cost"))
    c = d["ceilings"]
    if c["mem_bw_gbs"] or c["peak_tflops"]:
        rows.append(("ceilings", f"{_sig(c['mem_bw_gbs'])} GB/s, "
                     + ", ".join(f"{k} {_sig(v)} TFLOP/s" for k, v in c["peak_tflops"].items())
                     + f" ({c['source'] or c['kind'] or '?'})"))
    rows.append(("kprof", h["kprof_version"] or "?"))
    if d.get("trace_path"):  # a path, not a link: the page may be read away from the run's folder
        rows.append(("trace", f"{d['trace_path']} (open in Perfetto: ui.perfetto.dev)"))
    out = ['<table class="hdr">'] + [f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in rows] + ["</table>"]
    for w in [*c["notes"], *h["warnings"]]:
        out.append(f'<p class="note">note: {_e(w)}</p>')
    return "".join(out)


def _points_note(d: dict) -> str:
    off = [p for p in d["points"] if not p["placed"]]
    if not off:
        return ""
    ms = sum(p["ms_per_step"] for p in off)
    items = "".join(f"<li>{_e(p['op'])} in {_e(p['module'] or '(root)')}: {_sig(p['ms_per_step'])} ms/step, "
                    f"{_e(p['why_not'])}</li>" for p in off[:10])
    more = f"<li>... and {len(off) - 10} more</li>" if len(off) > 10 else ""
    return (f"<details><summary>{len(off)} op groups ({_sig(ms)} ms/step) are not on the roofline "
            f"(no FLOPs or no cost formula)</summary><ul>{items}{more}</ul></details>")


def _classes(d: dict) -> str:
    rows = []
    for r in d["classes"]:
        cls = str(r.get("class", "?"))
        swatch = f'<i style="display:inline-block;width:10px;height:10px;background:{CLASS_COLOUR.get(cls, "#888")}"></i> '
        rows.append([swatch + _e(cls), _sig(_first(r, ["time/step (ms)", "ms/step", "time (ms/step)"])),
                     _pct(_first(r, ["% of step"]))])
    return _table(["class", "ms/step", "% of step"], rows, {1, 2}) if rows else "<p>no class breakdown in the summary</p>"


def _top_ops(d: dict) -> str:
    rows = [[_e(r.get("module") or "(root)"), _e(r.get("op")), f"<code>{_e(r.get('shapes'))}</code>", _e(r.get("dtype")),
             _sig(_first(r, ["time/step (ms)", "ms/step"])), _pct(r.get("% of step")), _sig(r.get("TFLOP/s")),
             _sig(r.get("GB/s")), _sig(r.get("intensity (FLOP/B)")), _pct(r.get("% of roofline")), _e(r.get("class"))]
            for r in d["top_ops"]]
    if not rows:
        return "<p>no top ops in the summary</p>"
    return _table(["module", "op", "shapes", "dtype", "ms/step", "% step", "TFLOP/s", "GB/s", "FLOP/B", "% roof",
                   "class"], rows, {4, 5, 6, 7, 8, 9})


def _syncs(d: dict) -> str:
    if not d["syncs"]:
        return "<p>none seen in the recorded steps</p>"
    rows = [[_e(f"{s.get('file', '?')}:{s.get('line', '?')}"), _e(s.get("kind")), _e(s.get("count")),
             f"<code>{_e(str(s.get('code') or '').strip())}</code>"] for s in d["syncs"]]
    note = ('<p class="note">CPU run: nothing waits here, but each of these would sync the host with the GPU.</p>'
            if d["cpu"] else "")
    return _table(["where", "kind", "count", "code"], rows, {2}) + note


def _suggestions(d: dict) -> str:
    if not d["suggestions"]:
        return "<p>no plan: run <code>kprof suggest</code> for ranked suggestions</p>" if any(
            "plan.json" in m for m in d["missing"]) else "<p>the plan has no suggestions</p>"
    rows = []
    for r in d["suggestions"]:
        saving = r.get("saving ms/step")
        rows.append([_e(r.get("rank")), _e(r.get("id")), _e(r.get("where")),
                     _e(r.get("evidence") or f"{_sig(r.get('ms/step'))} ms/step, {r.get('class', '?')}"),
                     _e(r.get("change")), _sig(saving) if isinstance(saving, (int, float)) else "?",
                     _e(r.get("confidence")), f"<code>{_e(r.get('how'))}</code>"])
    return _table(["#", "id", "where", "evidence", "change", "saving ms/step", "confidence", "how"], rows, {0, 5})


def render_html(d: dict) -> str:
    """The whole report page."""
    blob = json.dumps(store.jsonable(d), allow_nan=False).replace("</", "<\\/")  # no early </script>
    banner = ('<div class="banner" id="cpu-banner"><b>CPU run.</b> Op times are CPU self times and the roofline '
              "uses this CPU's ceilings, not a GPU's: classes and percentages describe this CPU. Profile on the "
              "GPU for GPU numbers.</div>") if d["cpu"] else ""
    missing = ('<div class="missing" id="missing"><b>Missing from this run:</b><ul>'
               + "".join(f"<li>{_e(m)}</li>" for m in d["missing"]) + "</ul></div>") if d["missing"] else ""
    svg = roofline_svg(d)
    placed = sum(p["placed"] for p in d["points"])
    legend = '<p class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_e(k)}</span>'
                                              for k, c in CLASS_COLOUR.items() if k != "idle") + "</p>"
    roof = (f"<p>{placed} of {len(d['points'])} op groups (module, op), area by time per step; hover a point.</p>"
            + legend + svg + _points_note(d)) if svg else "<p>no roofline: no op table or no ceilings</p>"
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>kprof report · {_e(d["run"])}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head><body>'
            f'<h1>kprof report · {_e(d["run"])}</h1>{banner}{missing}'
            # The roofline first: it is what the page is for; the run's details follow it.
            f"<h2>Roofline</h2>{roof}<h2>Run</h2>{_header(d)}<h2>Time per class (per step)</h2>{_classes(d)}"
            f"<h2>Top ops by time</h2>{_top_ops(d)}<h2>Host syncs</h2>{_syncs(d)}"
            f"<h2>Suggestions</h2>{_suggestions(d)}"
            f'<div id="tip"></div><script type="application/json" id="kprof-data">{blob}</script>'
            f"<script>{JS}</script></body></html>\n")

"""`kprof report --html` and `kprof apply --html`: one self-contained HTML file from
kprof.analyze.report's data, with the parts built here from the run's tables: the step timeline,
the module tree, the run's metadata and, for the run of an apply, the before/after view.

Nothing is fetched when the file is opened (it must work offline and be mailable): the CSS and
the script are inline, the data is embedded as JSON (<script type="application/json">), and the
roofline and the step bars are SVG drawn here, in Python. Drawing them server-side keeps the file
small (no charting library), lets a test count the points and arrows with html.parser, and leaves
the pictures intact with scripts off; the inline script only adds the hover tooltip and sorts the
module tree. The data functions (step_timeline, module_tree, before_after) are pure: the CLI reads
the files and names what is missing.
"""

from __future__ import annotations

import json
import math
import numbers
from html import escape
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from kprof import store
from kprof.analyze.modules import module_table, parent_path
from kprof.analyze.report import roofline_points
from kprof.analyze.tables import CLASSES, class_breakdown, module_breakdown

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
.arrow{stroke:#d9480f;stroke-width:1.6}.ba-before{fill:#fff;stroke:#d9480f;stroke-width:1.5}.ba-after{fill:#d9480f}
svg text.ba-label{fill:#d9480f;font-weight:600}
.leader{stroke:#d9480f;stroke-width:.7;stroke-opacity:.6}.sync-mark{fill:#222}
.mt-head,.mt>summary,.mt.leaf{display:grid;grid-template-columns:minmax(220px,1fr) repeat(var(--cols),80px);
gap:0 8px;font-size:13px;padding:1px 0}.mt-head{font-weight:600;border-bottom:1px solid #ccc}
.mt-head span{cursor:pointer;user-select:none}.mt-head [aria-sort=descending]::after{content:" \\25BE"}
.mt-head [aria-sort=ascending]::after{content:" \\25B4"}.mt>summary{cursor:pointer;list-style:none}
.mt>summary::-webkit-details-marker{display:none}.mt>summary>.nm::before{content:"\\25B8  ";color:#888}
.mt[open]>summary>.nm::before{content:"\\25BE  "}.mt.leaf>.nm::before{content:"\\B7  ";color:#bbb}
.mt .n,.mt-head .n{text-align:right;font-variant-numeric:tabular-nums}.nm small{color:#888}
.mt>summary:hover,.mt.leaf:hover{background:#f2f5fa}
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
  // The module tree: a header click sorts every level by that column (numbers largest first,
  // again to reverse); #sort=KEY (or KEY-asc, KEY-desc) in the address sorts on load.
  var tree=document.getElementById('modtree');
  function sortTree(k,desc){
    tree.querySelectorAll('.mt-kids').forEach(function(box){
      var kids=Array.prototype.slice.call(box.children);
      kids.sort(function(a,b){
        var x=a.getAttribute('data-'+k),y=b.getAttribute('data-'+k);
        if(k!=='name'){x=parseFloat(x)||0;y=parseFloat(y)||0;}
        return (x<y?-1:x>y?1:0)*(desc?-1:1);
      });
      kids.forEach(function(c){box.appendChild(c);});
    });
    tree.querySelectorAll('.mt-head [data-k]').forEach(function(h){
      h.setAttribute('aria-sort',h.getAttribute('data-k')===k?(desc?'descending':'ascending'):'none');
    });
    tree.setAttribute('data-sorted',k+(desc?'-desc':'-asc'));
  }
  if(tree){
    tree.querySelectorAll('.mt-head [data-k]').forEach(function(h){
      function go(){var k=h.getAttribute('data-k'),s=h.getAttribute('aria-sort');
        sortTree(k,s==='ascending'?true:s==='descending'?false:k!=='name');}
      h.addEventListener('click',go);
      h.addEventListener('keydown',function(e){if(e.key==='Enter'||e.key===' '){e.preventDefault();go();}});
    });
    var m=/sort=(\\w+?)(?:-(asc|desc))?$/.exec(location.hash);
    if(m&&tree.querySelector('.mt-head [data-k="'+m[1]+'"]'))sortTree(m[1],m[2]?m[2]==='desc':m[1]!=='name');
  }
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


# --------------------------------------------------------------------------------------------
# The parts of the page built here from the run's tables (pure: no file is read)


def _num(v: Any) -> float | None:
    """A finite number from the run's JSON, else None (a string is not read as one)."""
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _ms(us: Any) -> float | None:
    v = _num(us)
    return None if v is None else v / 1e3


def n_steps(summary: dict | None, ops: pd.DataFrame | None) -> int:
    """The run's recorded steps: the summary's count, else the op table's, else 1."""
    n = int((summary or {}).get("steps_recorded") or 0)
    return n or (int(ops["step"].nunique()) if ops is not None and len(ops) and "step" in ops else 1)


def run_meta(summary: dict) -> dict:
    """What the header adds to report_data's: the date, the command, the versions, the device."""
    dev = summary.get("device") or {}
    versions = dict(summary.get("versions") or {k: dev[k] for k in ("torch", "triton", "cuda", "python") if dev.get(k)})
    gpu = []
    if dev.get("capability"):
        gpu.append(f"sm {dev['capability']}")
    if dev.get("sm_count"):
        gpu.append(f"{dev['sm_count']} SMs")
    if _num(dev.get("total_memory")):
        gpu.append(f"{dev['total_memory'] / 2**30:.0f} GiB")
    if dev.get("cpu_count"):
        gpu.append(f"{dev['cpu_count']} cores")
    argv = " ".join(str(a) for a in summary.get("argv") or [])
    ap = summary.get("apply_of") or {}
    cmd = f"kprof profile {summary.get('script', '?')}"
    if ap:
        cmd = f"kprof apply {summary.get('script', '?')} --patch {','.join(map(str, ap.get('patches') or [])) or '?'}"
    return {"created": summary.get("created"), "versions": versions, "device_details": ", ".join(gpu),
            "command": cmd + (f" -- {argv}" if argv else "")}


def step_timeline(summary: dict, ops: pd.DataFrame | None) -> dict:
    """One row per recorded step: its device window, busy and idle time (summary.json's
    idle_by_step), its op time per class (the op table, by tables.class_breakdown) and the host
    syncs seen in it (the sync detector counts recorded step j as its step j + 1)."""
    idle = {int(r["step"]): r for r in summary.get("idle_by_step") or []
            if isinstance(r, dict) and _num(r.get("step")) is not None}
    by_step: dict[int, dict] = {}
    if ops is not None and len(ops) and "step" in ops and "class" in ops:
        for step, sub in ops.groupby("step", sort=True):
            cb = class_breakdown(sub, None, 1)
            by_step[int(step)] = {r["class"]: float(r["time/step (ms)"]) for r in cb.to_dict("records")}
    syncs: dict[int, list[dict]] = {}
    for s in summary.get("syncs") or []:
        where = f"{Path(str(s.get('file') or '?')).name}:{s.get('line', '?')}"
        for st in s.get("steps") or []:
            if isinstance(st, int):
                syncs.setdefault(st - 1, []).append({"where": where, "file": s.get("file"), "line": s.get("line"),
                                                     "kind": s.get("kind"), "code": str(s.get("code") or "").strip()})
    rows = []
    for step in sorted(set(idle) | set(by_step)):
        r = idle.get(step, {})
        classes = {c: by_step[step][c] for c in CLASSES if by_step.get(step, {}).get(c)}
        rows.append({"step": step, "window_ms": _ms(r.get("window (us)")), "busy_ms": _ms(r.get("busy (us)")),
                     "idle_ms": _ms(r.get("idle (us)")), "idle_pct": _num(r.get("idle (%)")),
                     "classes": classes, "op_ms": sum(classes.values()) if step in by_step else None,
                     "syncs": syncs.get(step, [])})
    return {"rows": rows, "step_ms": _num((summary.get("step_time_ms") or {}).get("median"))}


def module_tree(ops: pd.DataFrame | None, n_steps: int, module_classes: dict | None = None,
                before: pd.DataFrame | None = None, before_steps: int = 0) -> list[dict]:
    """The modules as a tree, in depth-first order, children by time: each node's own time
    (tables.module_breakdown) and its subtree's, fwd and bwd, in ms per step. `before` (the op
    table of an apply's before run) adds each node's subtree time there. Pseudo-modules
    (<optimizer>, <unattributed>) are roots beside the model's."""
    if ops is None or not len(ops):
        return []

    def totals(df: pd.DataFrame, n: int) -> tuple[dict, dict]:
        own = {r["module"]: r for r in module_breakdown(df, n).to_dict("records")}
        incl: dict[str, list[float]] = {}
        for path, r in own.items():
            p: str | None = path
            while p is not None:
                t = incl.setdefault(p, [0.0, 0.0, 0.0])
                t[0] += r["fwd (ms/step)"]
                t[1] += r["bwd (ms/step)"]
                t[2] += r["time/step (ms)"]
                p = None if p.startswith("<") else parent_path(p)
        return own, incl

    own, incl = totals(ops, n_steps)
    b_incl = totals(before, before_steps)[1] if before is not None and len(before) else None
    paths = set(incl) | set(b_incl or {})
    kids: dict[str | None, list[str]] = {}
    for p in paths:
        par = None if p.startswith("<") else parent_path(p)
        if par is not None and par not in paths:  # only in the before run, under a path that is
            par = None
        kids.setdefault(par, []).append(p)
    all_ms = sum(r["time/step (ms)"] for r in own.values()) or 1.0
    classes = module_table(ops, module_classes)["module_class"].to_dict()
    out: list[dict] = []

    def walk(p: str, depth: int) -> None:
        f, b, t = incl.get(p, (0.0, 0.0, 0.0))
        o = own.get(p)
        node = {"path": p, "name": p.rsplit(".", 1)[-1] if p else "(root)", "class": classes.get(p, ""),
                "parent": None if p.startswith("<") else parent_path(p), "depth": depth, "fwd_ms": f, "bwd_ms": b,
                "total_ms": t, "own_ms": o["time/step (ms)"] if o else 0.0, "pct": 100.0 * t / all_ms,
                "children": len(kids.get(p, []))}
        if b_incl is not None:
            node["before_ms"] = b_incl.get(p, [0.0, 0.0, 0.0])[2]
        out.append(node)
        for c in sorted(kids.get(p, []), key=lambda c: -(incl.get(c, [0, 0, 0])[2] or 0.0)):
            walk(c, depth + 1)

    for root in sorted(kids.get(None, []), key=lambda c: (c.startswith("<"), -incl.get(c, [0, 0, 0])[2])):
        walk(root, 0)
    return out


def _kernel_ops(rule) -> set[str]:
    """The custom ops (kprof::*) a rule's kernels run, from the kernel registry's cost table."""
    from kprof.rules.engine import kernel_spec

    return {name for ref in rule.kernels if (spec := kernel_spec(ref)) is not None for name in spec.op_costs}


def before_after(doc: dict, rules: Sequence[Any], *, before_summary: dict | None, before_ops: pd.DataFrame | None,
                 before_plan: dict | None, after_summary: dict, after_ops: pd.DataFrame | None) -> dict:
    """apply.json's patches, each with a roofline point in the before run (the ops its rule's
    evidence selects at the planned module paths, as `kprof suggest` measured them) and one in the
    after run (the ops of the rule's kprof kernels, by the op the code called: a kernel's own
    matmuls count with it). A point is roofline_points' record of that group; `arrow` says both
    can be drawn, else `why` says what is missing."""
    from kprof.rules.engine import evidence_ops, match_pattern

    by_id = {r.id: r for r in rules}
    planned = {s.get("id"): s.get("paths") for s in (before_plan or {}).get("suggestions") or []}
    table = module_table(before_ops, (before_summary or {}).get("module_classes")) \
        if before_ops is not None and len(before_ops) else None
    called = None
    if after_ops is not None and len(after_ops):
        called = after_ops["called_op"].fillna(after_ops["op"]) if "called_op" in after_ops else after_ops["op"]
    sel_b, sel_a, why = [], [], {}
    for p in doc.get("patches") or []:
        pid = str(p.get("id"))
        rule = by_id.get(pid)
        if rule is None:
            why[pid] = f"no rule {pid} in this kprof"
            continue
        if table is None:
            why[pid] = "the before run's op table is missing"
        else:
            paths = planned.get(pid)
            if not isinstance(paths, list) or not paths:
                paths = match_pattern(rule.profile, table)
            parts = [evidence_ops(rule.profile, before_ops, table, x) for x in paths if x in table.index]
            if parts and sum(map(len, parts)):
                ev = pd.concat(parts)
                sel_b.append(ev.assign(_op=ev["op"], module=pid, op="patched ops"))
            else:
                why[pid] = "no matched ops in the before run"
        names = _kernel_ops(rule)
        if called is None:
            why.setdefault(pid, "the after run's op table is missing")
        elif p.get("kept") is False and not called.isin(names).any():
            why.setdefault(pid, "not kept, so not in the after run")
        elif not names:
            why.setdefault(pid, "its replacement runs aten ops, no kprof kernel to find in the after run")
        elif not called.isin(names).any():
            why.setdefault(pid, "its kernels did not run in the after run (not installed)")
        else:
            ev = after_ops[called.isin(names)]
            sel_a.append(ev.assign(_op=ev["op"], module=pid, op="patched ops"))

    def points(sel: list, n: int, summary: dict | None) -> dict:
        if not sel:
            return {}
        step_ms = _num(((summary or {}).get("step_time_ms") or {}).get("median"))
        df = pd.concat(sel)
        pts = {pt["module"]: pt for pt in roofline_points(df, n, step_ms)}
        if "cost_known" in df:  # name the ops that keep a group off the roofline
            for pid, g in df[~df["cost_known"].fillna(False).astype(bool)].groupby("module"):
                if pid in pts and not pts[pid]["placed"]:
                    pts[pid]["why_not"] = f"no FLOP/byte cost formula for {', '.join(sorted(set(g['_op'])))}"
        return pts

    pb = points(sel_b, n_steps(before_summary, before_ops), before_summary)
    pa = points(sel_a, n_steps(after_summary, after_ops), after_summary)
    patches = []
    for p in doc.get("patches") or []:
        pid = str(p.get("id"))
        b, a = pb.get(pid), pa.get(pid)
        w = why.get(pid)
        if w is None and not b["placed"]:
            w = f"before: {b['why_not']}"
        if w is None and not a["placed"]:
            w = f"after: {a['why_not']}"
        patches.append({k: p.get(k) for k in ("id", "where", "verified", "kept", "verdict", "reason",
                                              "predicted_saving_ms", "measured_saving_ms", "measured_interval_ms",
                                              "n", "memory_saving_bytes")}
                       | {"before": b, "after": a, "arrow": w is None, "why": w})
    return {"before_run": doc.get("before_run"), "after_run": doc.get("after_run"),
            "before_ms": _num(doc.get("before_ms")), "after_ms": _num(doc.get("after_ms")),
            "steps": list(doc.get("steps") or []),
            "recommendation": doc.get("recommendation"), "notes": list(doc.get("notes") or []),
            "not_installed": list(doc.get("not_installed") or []), "patches": patches}


# --------------------------------------------------------------------------------------------
# Rendering


def arrows(data: dict) -> list[tuple[int, dict]]:
    """The before/after view's patches that have both points (index into the patch list)."""
    return [(j, g) for j, g in enumerate((data.get("before_after") or {}).get("patches") or []) if g["arrow"]]


def roofline_svg(data: dict) -> str:
    """The log-log roofline: x intensity (FLOP/B), y achieved TFLOP/s; the device's memory slope
    and compute peaks; one circle per placed point, area by time, colour by class; after an
    apply, one arrow per patch from its ops' point in the before run to its kernels' in the after."""
    pts = [(i, p) for i, p in enumerate(data["points"]) if p["placed"]]
    moves = arrows(data)
    c = data["ceilings"]
    bw, peaks = c["mem_bw_gbs"], c["peak_tflops"]
    xs = [p["intensity"] for _, p in pts] + [g[k]["intensity"] for _, g in moves for k in ("before", "after")]
    ys = [p["tflops"] for _, p in pts] + [g[k]["tflops"] for _, g in moves for k in ("before", "after")]
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
    if moves:  # drawn last: on top of the points
        out.append('<defs><marker id="ah" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
                   'orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" fill="#d9480f"/></marker></defs>')
    # The labels stand in a column right of the arrows' heads (left where there is no room), one
    # line apart, each tied to its head by a thin leader: heads of several patches often meet.
    heads = {j: (sx(g["after"]["intensity"]), sy(g["after"]["tflops"])) for j, g in moves}
    lw = max((6.5 * len(str(g["id"])) for _, g in moves), default=0.0)
    col = max((x for x, _ in heads.values()), default=0.0) + 28
    if col + lw > ML + pw:
        col = min((x for x, _ in heads.values()), default=0.0) - 28 - lw
    label_y: dict[int, float] = {}
    for j in sorted(heads, key=lambda j: heads[j][1]):
        label_y[j] = max(heads[j][1] + 4, max(label_y.values(), default=-1e9) + 13)
    for j, g in moves:
        b, a = g["before"], g["after"]
        bx, by, (ax, ay) = sx(b["intensity"]), sy(b["tflops"]), heads[j]
        n = math.hypot(ax - bx, ay - by) or 1.0
        ex, ey = ax - (ax - bx) * min(5 / n, 1), ay - (ay - by) * min(5 / n, 1)  # the head stops at the dot
        ly = label_y[j]
        tip = (f'{_e(g["id"])}: {_sig(b["ms_per_step"])} → {_sig(a["ms_per_step"])} ms/step, '
               f'{_sig(b["tflops"])} → {_sig(a["tflops"])} TFLOP/s, {_sig(b["intensity"])} → '
               f'{_sig(a["intensity"])} FLOP/B')
        out.append(f'<g class="move" data-b="{j}"><title>{tip}</title>'
                   f'<rect class="ba-before" x="{bx - 4:.1f}" y="{by - 4:.1f}" width="8" height="8"/>'
                   f'<line class="arrow" x1="{bx:.1f}" y1="{by:.1f}" x2="{ex:.1f}" y2="{ey:.1f}" '
                   'marker-end="url(#ah)"/>'
                   f'<circle class="ba-after" cx="{ax:.1f}" cy="{ay:.1f}" r="4"/>'
                   f'<line class="leader" x1="{ax + (4 if col > ax else -4):.1f}" y1="{ay:.1f}" '
                   f'x2="{col - 3 if col > ax else col + lw + 3:.1f}" y2="{ly - 4:.1f}"/>'
                   f'<text class="ba-label" x="{col:.1f}" y="{ly:.1f}">{_e(g["id"])}</text></g>')
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset(),
           row_attrs: Sequence[str] | None = None) -> str:
    """A table from already-escaped cells; columns in `numeric` are right-aligned."""
    th = "".join(f'<th class="n">{h}</th>' if j in numeric else f"<th>{h}</th>" for j, h in enumerate(head))
    attrs = row_attrs or [""] * len(rows)
    body = "".join(f"<tr{at}>" + "".join(f'<td class="n">{c}</td>' if j in numeric else f"<td>{c}</td>"
                                          for j, c in enumerate(r)) + "</tr>" for r, at in zip(rows, attrs))
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _header(d: dict) -> str:
    h, m = d["header"], d.get("meta") or {}
    rows = [("run", d["run"])]
    if (d.get("before_after") or {}).get("before_run"):
        rows.append(("before run", f"{d['before_after']['before_run']} (the script as written; this run is "
                                   "its patched run from kprof apply)"))
    rows += [("date", m.get("created") or "?"), ("command", m.get("command") or h["script"]),
             ("status", " · ".join(x for x in (h["status"] or "?", h["status_note"]) if x)),
             ("device", f"{h['device'] or '?'} ({h['device_type'] or '?'})"
                        + (f", {m['device_details']}" if m.get("device_details") else "")),
             ("versions", " · ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items())
              or f"kprof {h['kprof_version'] or '?'}"),
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
    cells = [(_e(k), _e(v)) for k, v in rows]
    cells.append(("trace", _trace_cell(d)))
    out = ['<table class="hdr">'] + [f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in cells] + ["</table>"]
    for w in [*c["notes"], *h["warnings"]]:
        out.append(f'<p class="note">note: {_e(w)}</p>')
    return "".join(out)


def _trace_cell(d: dict) -> str:
    """The run's Perfetto trace: a link relative to the page (it holds while the page stays beside
    the run, as written) and the full path; none is named as such."""
    if not d.get("trace_path"):
        return "none in this run: no timeline to open (see above)" if any(
            store.TRACE in m for m in d["missing"]) else "none in this run"
    href = d.get("trace_href")
    link = f'<a id="trace-link" href="{_e(href)}">{_e(Path(d["trace_path"]).name)}</a> ' if href else ""
    return (f"{link}<code>{_e(d['trace_path'])}</code><br>the step timeline of every op and kernel: open it in "
            "Perfetto (ui.perfetto.dev, “Open trace file”); it stays on your machine")


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


TL_W = 300  # the step bars' width (px)


def _timeline(d: dict) -> str:
    rows = (d.get("timeline") or {}).get("rows") or []
    if not rows:
        return "<p>no recorded steps: the summary has no idle_by_step and the op table is missing</p>"
    classes = [c for c in CLASSES if any(c in r["classes"] for r in rows)]
    span = max((r["window_ms"] or r["busy_ms"] or r["op_ms"] or 0.0) for r in rows) or 1.0
    busy_word = "CPU op time" if d["cpu"] else "GPU busy"
    out = []
    for r in rows:
        busy = r["busy_ms"] if r["busy_ms"] is not None else (r["op_ms"] or 0.0)
        op_ms = sum(r["classes"].values())
        x, bar = 0.0, []
        for c in classes:  # each class's share of the op time, drawn into the busy time
            w = TL_W * busy / span * r["classes"].get(c, 0.0) / op_ms if op_ms else 0.0
            if w > 0:
                bar.append(f'<rect x="{x:.1f}" y="2" width="{w:.1f}" height="12" fill="{CLASS_COLOUR[c]}">'
                           f"<title>{c}: {_sig(r['classes'][c])} ms</title></rect>")
            x += w
        if r["idle_ms"]:
            w = TL_W * r["idle_ms"] / span
            bar.append(f'<rect x="{x:.1f}" y="2" width="{w:.1f}" height="12" fill="{CLASS_COLOUR["idle"]}">'
                       f"<title>idle: {_sig(r['idle_ms'])} ms</title></rect>")
            x += w
        for k, sy_ in enumerate(r["syncs"]):  # where in the step is not recorded: at its end
            bar.append(f'<path class="sync-mark" d="M{x - 4 - 7 * k:.1f},16 l4,-6 l4,6z"><title>host sync '
                       f"{_e(sy_['where'])}: {_e(sy_['code'])}</title></path>")
        syncs = "<br>".join(f"<code>{_e(sy_['where'])}</code> {_e(sy_['kind'])}" for sy_ in r["syncs"])
        cells = [str(r["step"]), _sig(r["window_ms"]), _sig(busy), _sig(r["idle_ms"]), _pct(r["idle_pct"])]
        cells += [_sig(r["classes"].get(c)) for c in classes]
        cells.append(f'<svg class="tl" width="{TL_W}" height="18" role="img" aria-label="step {r["step"]}">'
                     + "".join(bar) + "</svg>")
        cells.append(syncs)
        out.append(cells)
    head = ["step", "window ms", f"{'op time' if d['cpu'] else 'busy'} ms", "idle ms", "idle"]
    head += [f"{c.split('-')[0]} ms" for c in classes] + ["busy by class, then idle", "host syncs"]
    table = _table(head, out, set(range(1, 5 + len(classes))), [f' data-step="{r["step"]}"' for r in rows])
    step_ms = (d.get("timeline") or {}).get("step_ms")
    note = (f"Each recorded step as the profiler saw it: the window is the step's span on the "
            f"{'CPU' if d['cpu'] else 'device'}, {busy_word} the time some op or kernel ran in it, the class columns "
            "the op time per class (overlapping streams can add up to more than busy). ")
    if step_ms and any(r["window_ms"] for r in rows):
        note += (f"The unprofiled step is {_sig(step_ms)} ms (median): the profiler adds host time, so these windows "
                 "run longer and their idle time with them. ")
    note += "Host syncs (▲) are marked in the steps they were seen in, with their source line."
    return f'<p>{note}</p><div id="timeline">{table}</div>'


def _modules(d: dict) -> str:
    nodes = d.get("modules") or []
    if not nodes:
        return "<p>no module tree: it needs the op table</p>"
    before = "before_ms" in nodes[0]
    cols = [("fwd", "fwd ms", "fwd_ms"), ("bwd", "bwd ms", "bwd_ms"), ("tot", "total ms", "total_ms"),
            ("own", "own ms", "own_ms"), ("pct", "% op time", "pct")]
    if before:
        cols += [("before", "before ms", "before_ms"), ("delta", "change ms", None)]
    head = ('<div class="mt-head"><span data-k="name" role="button" tabindex="0" aria-sort="none">module</span>'
            + "".join(f'<span class="n" data-k="{k}" role="button" tabindex="0" '
                      f'aria-sort="{"descending" if k == "tot" else "none"}">{h}</span>' for k, h, _ in cols)
            + "</div>")

    def vals(n: dict) -> dict:
        v = {k: n[f] for k, _, f in cols if f}
        if before:
            v["delta"] = n["total_ms"] - n["before_ms"]
        return v

    out, depth = [], []
    for n in nodes:
        while depth and depth[-1] >= n["depth"]:
            out.append("</div></details>")
            depth.pop()
        v = vals(n)
        attrs = (f'data-path="{_e(n["path"])}" data-parent="{_e(n["parent"] if n["parent"] is not None else "")}" '
                 f'data-name="{_e(n["name"])}" ' + " ".join(f'data-{k}="{x:.6g}"' for k, x in v.items()))
        cells = (f'<span class="nm" style="padding-left:{14 * n["depth"]}px">{_e(n["name"])} '
                 f'<small>{_e(n["class"])}</small></span>'
                 + "".join(f'<span class="n">{_pct(v[k]) if k == "pct" else _sig(v[k])}</span>' for k, _, _ in cols))
        if n["children"]:
            out.append(f'<details class="mt" {attrs}{" open" if n["depth"] < 2 else ""}><summary>{cells}</summary>'
                       '<div class="mt-kids">')
            depth.append(n["depth"])
        else:
            out.append(f'<div class="mt leaf" {attrs}>{cells}</div>')
    out += ["</div></details>"] * len(depth)
    note = ("Time per step of each module's subtree (its own ops and its children's), forward and backward; own: "
            "its own ops only. Click a header to sort every level by it.")
    if before:
        note += " before: the same subtree in the before run; change: after − before."
    return (f'<p>{note}</p><div id="modtree" style="--cols:{len(cols)}" data-sorted="tot-desc">{head}'
            f'<div class="mt-kids" id="mt-root">{"".join(out)}</div></div>')


def _ms_cell(v: Any) -> str:
    return "?" if _num(v) is None else _sig(v)


def _before_after(d: dict) -> str:
    ba = d.get("before_after")
    if not ba:
        return ""
    out = []
    b, a = ba.get("before_ms"), ba.get("after_ms")
    line = f"before: run {_e(ba['before_run'])} → after: run {_e(ba['after_run'])}"
    if b and a:
        line += f", {_sig(b)} → {_sig(a)} ms per unprofiled step ({(a - b) / b * 100:+.1f}%)"
    out.append(f"<p>{line}.</p>")
    if ba["steps"]:
        out.append(_table(["metric", "before", "after", "change"],
                          [[_e(r.get("metric")), _sig(r.get("before")), _sig(r.get("after")),
                            "–" if _num(r.get("change %")) is None else f"{r['change %']:+.1f}%"]
                           for r in ba["steps"]],
                          {1, 2, 3}))
    rows = []
    for g in ba["patches"]:
        pb, pa = g["before"], g["after"]
        iv = g.get("measured_interval_ms")
        meas = _ms_cell(g.get("measured_saving_ms"))
        if isinstance(iv, list) and len(iv) == 2 and all(_num(x) is not None for x in iv):
            meas += f" [{_sig(iv[0])}, {_sig(iv[1])}]"
        if g.get("n"):
            meas += f" n={g['n']}"
        mem = _num(g.get("memory_saving_bytes"))
        rows.append([_e(g["id"]), _e(g.get("where")), _e(g.get("verdict") or ("kept" if g.get("kept") else "?")),
                     "yes" if g.get("verified") else "no" if g.get("verified") is False else "?",
                     _ms_cell(g.get("predicted_saving_ms")), meas,
                     "–" if mem is None else f"{round(mem / 2**20):,} MiB",
                     f"{_ms_cell(pb and pb['ms_per_step'])} → {_ms_cell(pa and pa['ms_per_step'])}",
                     f"{_ms_cell(pb and pb['tflops'])} → {_ms_cell(pa and pa['tflops'])}",
                     "drawn" if g["arrow"] else _e(g["why"])])
    out.append(_table(["patch", "where", "verdict", "verified", "predicted saving ms/step",
                       "measured saving ms/step [95%]", "memory saved", "its ops ms/step", "TFLOP/s", "arrow"],
                      rows, {4, 5, 6, 7, 8}) if rows else "<p>apply.json lists no patches</p>")
    for n in ba["not_installed"]:
        out.append(f'<p class="note">not installed: {_e(n.get("id"))}: {_e(n.get("why"))}</p>')
    for n in ba["notes"]:
        out.append(f'<p class="note">note: {_e(n)}</p>')
    if ba.get("recommendation"):
        out.append(f"<p><b>recommendation:</b> {_e(ba['recommendation'])}</p>")
    out.append('<p class="note">predicted: the plan\'s estimate (measured time of the matched ops − the kernel\'s '
               "roofline time); measured: the ablation's paired difference in the step (all on but this patch − all "
               "on). Its ops: the patch's ops in the before run, its kernels' ops in the after run (the arrow's "
               "two ends).</p>")
    return "".join(out)


def render_html(d: dict) -> str:
    """The whole report page: report_data's dict, with the keys built here where the CLI added
    them (meta, timeline, modules, trace_href; before_after for the run of an apply)."""
    blob = json.dumps(store.jsonable(d), allow_nan=False).replace("</", "<\\/")  # no early </script>
    banner = ('<div class="banner" id="cpu-banner"><b>CPU run.</b> Op times are CPU self times and the roofline '
              "uses this CPU's ceilings, not a GPU's: classes and percentages describe this CPU. Profile on the "
              "GPU for GPU numbers.</div>") if d["cpu"] else ""
    missing = ('<div class="missing" id="missing"><b>Missing from this run:</b><ul>'
               + "".join(f"<li>{_e(m)}</li>" for m in d["missing"]) + "</ul></div>") if d["missing"] else ""
    ba = d.get("before_after")
    svg = roofline_svg(d)
    placed = sum(p["placed"] for p in d["points"])
    legend = '<p class="legend">' + "".join(f'<span><i style="background:{c}"></i>{_e(k)}</span>'
                                              for k, c in CLASS_COLOUR.items() if k != "idle") + "</p>"
    what = f"{placed} of {len(d['points'])} op groups (module, op)"
    if ba:
        n = len(arrows(d))
        what = (f"The before run ({_e(d.get('roofline_of') or ba['before_run'])}): {what}. Arrows: {n} of "
                f"{len(ba['patches'])} patches, from their ops in the before run (□) to their kernels in the "
                f"after run (●); the table below says why a patch has none")
    roof = (f"<p>{what}, area by time per step; hover a point.</p>" + legend + svg + _points_note(d)) if svg else \
        "<p>no roofline: no op table or no ceilings</p>"
    title = (f"kprof apply · {_e(ba['before_run'])} → {_e(d['run'])}" if ba else f"kprof report · {_e(d['run'])}")
    plan_of = (f"<p>The plan of the before run {_e(ba['before_run'])}, which apply ran.</p>"
               if ba and d["suggestions"] else "")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style></head><body>'
            f"<h1>{title}</h1>{banner}{missing}"
            # The roofline first: it is what the page is for; the run's details follow it.
            f"<h2>Roofline</h2>{roof}"
            + (f'<h2>Before/after (kprof apply)</h2><div id="before-after">{_before_after(d)}</div>' if ba else "")
            + "<h2>Run</h2>" + (f"<p>This section and those below are of the after run, {_e(d['run'])}.</p>"
                                  if ba else "")
            + f"{_header(d)}<h2>Step timeline</h2>{_timeline(d)}"
            f"<h2>Time per class (per step)</h2>{_classes(d)}<h2>Module tree</h2>{_modules(d)}"
            f"<h2>Top ops by time</h2>{_top_ops(d)}<h2>Host syncs</h2>{_syncs(d)}"
            f"<h2>Suggestions</h2>{plan_of}{_suggestions(d)}"
            f'<div id="tip"></div><script type="application/json" id="kprof-data">{blob}</script>'
            f"<script>{JS}</script></body></html>\n")

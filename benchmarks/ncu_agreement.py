"""kprof's class vs Nsight Compute on the H200: issue 26's table. NOT YET RUN (no GPU time when it
was written); nothing in benchmarks/results comes from it yet.

    python benchmarks/ncu_agreement.py [--out DIR] [--top 20] [--models llama1b,llama150m,gpt]

For each model: `kprof profile` (the library call), then one step under ncu for the top kernels by
time (kprof.analyze.ncu.cross_check: DRAM, SM, tensor / FMA / ALU pipe throughput, achieved
occupancy), each run's ncu.json saved in its run directory.

Then issue 26's method, fixed before measuring:
- fit: on the 1B-class Llama only, every candidate threshold (THRESHOLDS) re-qualifies that run's
  kernel rows (kprof.analyze.efficiency.qualify on kernels.parquet) and is scored against the same
  counters (no second ncu run); the threshold with the best time-weighted agreement wins, ties
  going to the lower threshold (the fewer kernels called under-used);
- score: the ~150M Llama (benchmarks/workloads/hf_llama_150m.py) and the GPT example at that
  threshold. The issue's bar: >= 90% of the top-20 kernels agree, by count and by time, on both.

Writes DIR/ncu-agreement.md: the fit curve, then per model the top kernels with kprof's class and
ncu's counters and the agreement by count and by time. Copy it to benchmarks/results/ with the
date, and put the fitted value into efficiency.UNDER_USED_THRESHOLD with its measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kprof import store
from kprof.analyze import efficiency, kernels, ncu
from kprof.analyze.profile import profile_script
from kprof.capture.ncu import find_ncu

MODELS = {
    # name: (script, script args, role)
    "llama1b": ("examples/llama_train.py", ["--preset", "1b", "--device", "cuda"], "fit"),
    "llama150m": ("benchmarks/workloads/hf_llama_150m.py", ["--steps", "40"], "score"),
    "gpt": ("examples/gpt_train.py", ["--device", "cuda", "--dtype", "bfloat16", "--batch-size", "16",
                                      "--seq-len", "1024", "--n-layer", "12", "--n-embd", "768", "--n-head", "12",
                                      "--steps", "40"], "score"),
}
THRESHOLDS = [x / 100 for x in range(10, 95, 5)]


def requalify(run, counters: pd.DataFrame, top: int, threshold: float) -> tuple[pd.DataFrame, dict]:
    """The run's kernel rows qualified at `threshold`, its top kernels compared with `counters`."""
    k = store.load_kernels(run.path)
    k = efficiency.qualify(k.drop(columns=[efficiency.QUALIFIER, "causes"]), gpu=True,
                           sm_count=(run.summary.get("device") or {}).get("sm_count"), threshold=threshold)
    sel = ncu.select(kernels.by_name(k, run.summary.get("steps_recorded") or 1), top)
    table = ncu.compare(sel, counters)
    return table, ncu.agreement(table)


def fmt(v, digits=0) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.{digits}f}"


def markdown(name: str, role: str, table: pd.DataFrame, a: dict, threshold: float) -> list[str]:
    head = (f"agreement: {a['agree']} of {a['scored']} scored ({fmt(a['by count (%)'], 1)}% by count, "
            f"{fmt(a['by time (%)'], 1)}% by time); {a['not scored']} not scored")
    out = [f"## {name} ({role}, threshold {threshold:.2f})", "", head, "",
           "| kernel | us/step | kprof | DRAM % | SM % | tensor % | FMA % | ALU % | occ. % | ncu | agree |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for _, r in table.iterrows():
        cls = efficiency.label(r["class"], bool(r[efficiency.QUALIFIER]))
        agree = "–" if r["agree"] is None else ("yes" if r["agree"] else "NO")
        name_ = str(r["kernel"]).replace("|", "\\|")[:90]
        out.append(f"| `{name_}` | {fmt(r['time/step (us)'])} | {cls} | {fmt(r['DRAM %'])} | {fmt(r['SM %'])} | "
                   f"{fmt(r['tensor %'])} | {fmt(r['FMA %'])} | {fmt(r['ALU %'])} | {fmt(r['occupancy %'])} | "
                   f"{r['ncu class'] or '–'} | {agree} |")
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "ncu-agreement"))
    ap.add_argument("--top", type=int, default=ncu.DEFAULT_TOP)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    ncu_path = find_ncu()
    if ncu_path is None:
        print("ncu is not on PATH; this benchmark needs Nsight Compute on a GPU machine", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measured = {}
    for name in args.models.split(","):
        script, argv, role = MODELS[name]
        run = profile_script(str(ROOT / script), argv, out_root=out / "runs")
        sel = ncu.select(ncu.plan(run), args.top)
        print(f"{name}: {len(sel)} kernels, about {ncu.estimate_seconds(sel):.0f} s under ncu", file=sys.stderr)
        with tempfile.TemporaryDirectory() as d:
            doc = ncu.cross_check(run, sel, ncu_path, d)
        measured[name] = (run, pd.DataFrame(doc["counters"]), role)

    intro = f"benchmarks/ncu_agreement.py, top {args.top} kernels per model; reference rule: kprof/analyze/ncu.py"
    lines = ["# kprof class vs Nsight Compute (H200)", "", intro, ""]
    fitted = efficiency.UNDER_USED_THRESHOLD
    fit = [n for n, (_, _, role) in measured.items() if role == "fit"]
    if fit:
        run, counters, _ = measured[fit[0]]
        curve = [(t, requalify(run, counters, args.top, t)[1]) for t in THRESHOLDS]
        fitted = max(curve, key=lambda ta: (ta[1]["by time (%)"] or 0.0, -ta[0]))[0]
        lines += [f"## fit on {fit[0]}", "", "| threshold | by count % | by time % |", "|---:|---:|---:|"]
        lines += [f"| {t:.2f} | {fmt(a['by count (%)'], 1)} | {fmt(a['by time (%)'], 1)} |" for t, a in curve]
        lines += ["", f"fitted threshold: {fitted:.2f}", ""]
    for name, (run, counters, role) in measured.items():
        table, a = requalify(run, counters, args.top, fitted)
        lines += markdown(name, role, table, a, fitted)
    (out / "ncu-agreement.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'ncu-agreement.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

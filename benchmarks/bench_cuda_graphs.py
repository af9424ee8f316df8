"""Issue 19 item 3's figure: the `cuda_graphs` patch on the small fp32 MLP (12 x Linear(256, 256)
+ ReLU, batch 32, Adam; benchmarks/workloads/mlp_cuda_graphs.py) must make the step >= 2x faster
than eager. NOT RUN YET: nothing in benchmarks/results comes from it.

    python benchmarks/bench_cuda_graphs.py [--out benchmarks/results/cuda_graphs.csv] [--steps 200]
                                           [--rounds 5] [--warmup 10]

Three variants of the same seeded training step, in one process, each its own model and Adam
(torch's default flags: foreach on CUDA), none profiled:
  - eager;
  - kprof: the patch installed through kprof's own install function, `kprof.patch(model,
    rules=["cuda_graphs"])` (verified at the first call, then recorded and replayed as CUDA
    graphs by torch.compile(mode="reduce-overhead"));
  - kprof+fused_optimizer: the same, plus kprof's switch of the Adam to its fused step
    (`optimizer=`, the unfused_optimizer patch): the optimizer's launches stay outside the graph,
    so this is what both patches together leave of the host's launch time;
  - compile: torch.compile(model) in its default mode (fusion, no graphs): how much of the win is
    the graph and how much the fusion.
After `--warmup` steps each (compiles, verification, graph recording), the variants' timed blocks
of `--steps` steps are interleaved over `--rounds` rounds (drift hits all alike). A step's time is
the gap between CUDA events recorded at consecutive step boundaries, no sync inside (as kprof
times steps); the figure is each variant's median over all its steps, with p10-p90, and the peak
of torch.cuda.max_memory_allocated over its blocks. Speed-up = eager median / variant median.

Writes one row per variant, appended, to the CSV (`--out`), and prints the table. Exits 2 with a
message without CUDA: the figure is about GPU launches.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import itertools
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "workloads"))
from mlp_cuda_graphs import BATCH, DEPTH, WIDTH, batch, mlp, train_step  # noqa: E402

FIELDS = ["time_utc", "gpu", "torch", "variant", "median_ms", "p10_ms", "p90_ms", "steps", "speedup_vs_eager",
          "peak_mib", "first_loss", "verification", "model"]


def variants() -> dict:
    """name -> (model, optimizer, kprof report or None), all from the same seed."""
    import kprof

    out = {}
    for name in ("eager", "kprof", "kprof+fused_optimizer", "compile"):
        torch.manual_seed(0)
        model = mlp().cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        report = None
        if name.startswith("kprof"):
            report = kprof.patch(model, rules=["cuda_graphs"], strict=True,
                                 optimizer=opt if name.endswith("fused_optimizer") else None)
            if report.declined:
                r = report.declined[0]
                raise SystemExit(f"bench_cuda_graphs: kprof declined {r.rule}: {r.note}")
        elif name == "compile":
            model = torch.compile(model)
        out[name] = (model, opt, report)
    return out


def timed_block(model, opt, x, y, steps: int) -> list[float]:
    """`steps` steps' times (ms) from CUDA events at the step boundaries."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    ev[0].record()
    for i in range(steps):
        train_step(model, opt, x, y)
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(ev)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_graphs.csv"))
    ap.add_argument("--steps", type=int, default=200, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved blocks per variant")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_cuda_graphs: no CUDA device; the figure is the GPU step time with and without CUDA graphs, "
              "run it on a GPU", file=sys.stderr)
        return 2
    x, y = batch("cuda")
    runs = variants()
    first_loss = {}
    for name, (model, opt, _) in runs.items():
        for i in range(args.warmup):
            loss = train_step(model, opt, x, y)
            if i == 0:
                first_loss[name] = loss.item()  # before any update: the same weights in every variant
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {n: [] for n in runs}
    peaks = dict.fromkeys(runs, 0)
    for _ in range(args.rounds):
        for name, (model, opt, _) in runs.items():
            torch.cuda.reset_peak_memory_stats()
            times[name] += timed_block(model, opt, x, y, args.steps)
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    eager = statistics.median(times["eager"])
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    rows = []
    for name, (_, _, report) in runs.items():
        t = sorted(times[name])
        med = statistics.median(t)
        q = statistics.quantiles(t, n=10)
        rows.append({"time_utc": now, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "variant": name, "median_ms": round(med, 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
                     "steps": len(t), "speedup_vs_eager": round(eager / med, 3), "peak_mib": round(peaks[name] / 2**20, 1),
                     "first_loss": first_loss[name],
                     "verification": "; ".join(f"{r.rule}: {r.verification.summary() if r.verification else r.note}"
                                               for r in report.records) if report else "",
                     "model": f"{DEPTH} x Linear({WIDTH},{WIDTH})+ReLU fp32, batch {BATCH}, Adam"})
    for r in rows:
        print(f"{r['variant']:8s} {r['median_ms']:8.4f} ms/step (p10 {r['p10_ms']:.4f}, p90 {r['p90_ms']:.4f})  "
              f"{r['speedup_vs_eager']:5.2f}x eager  peak {r['peak_mib']:7.1f} MiB  first loss {r['first_loss']:.6f}"
              + (f"  [{r['verification']}]" if r["verification"] else ""))
    kp = next(r for r in rows if r["variant"] == "kprof")
    print(f"issue 19 item 3: cuda_graphs {kp['speedup_vs_eager']:.2f}x eager (target >= 2x): "
          f"{'met' if kp['speedup_vs_eager'] >= 2 else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"appended {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

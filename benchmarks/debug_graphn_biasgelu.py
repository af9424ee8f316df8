"""Why bias+GELU(erf)'s forward times 284 us per call back to back in a CUDA graph (graphn_us,
2026-11-30 03:52 and 04:04, spread 8-30 us) but 261 us of kernel time under torch.profiler (eager
calls back to back) and 265-269 us in do_bench: the same kernel timed every way, tanh beside it.
For each: profiler kernel time (20 eager calls, one input); graph replay per call with 1, 2 and 8
calls per graph, on one input set and alternating two; and the kernel durations and gaps inside
one replay of the 8-call graph (torch.profiler sees graph kernel nodes). Run by gpu_run.sh's
`debug` stage; prints one table."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import graph_time_us  # noqa: E402
from benchmarks.cases.norms import kernel_time_us  # noqa: E402
from kprof.kernels import bias_gelu as bg  # noqa: E402


def inside_replay(steps, calls: int) -> list[tuple[float, float]]:
    """(duration, gap before) in us of each kernel of one replay of a `calls`-call graph."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.cuda.CUDAGraph()
    for s in steps:
        s()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(calls):
            steps[i % len(steps)]()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "bias_gelu" in e.name),
                key=lambda e: e.time_range.start)
    out, prev_end = [], None
    for e in ks:
        out.append((e.time_range.elapsed_us(), 0.0 if prev_end is None else e.time_range.start - prev_end))
        prev_end = e.time_range.end
    return out


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("debug_graphn_biasgelu: needs a CUDA GPU")
    torch.manual_seed(0)
    sets = [(torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16),
             torch.randn(16384, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    for approx in ("tanh", "none"):
        with torch.no_grad():
            f = [lambda x=x, b=b: bg.bias_gelu(x, b, approximate=approx) for x, b in sets]
            kt = kernel_time_us(f[0], [])
            row = [f"{approx:4s} profiler {kt:6.1f}"]
            for calls in (1, 2, 8):
                for name, steps in (("same", f[:1]), ("alt", f)):
                    if calls == 1 and name == "alt":
                        continue
                    t, spread = graph_time_us(steps, [], calls)
                    row.append(f"g{calls}{name} {t:6.1f}+-{spread:4.1f}")
            print("  ".join(row), flush=True)
            k = inside_replay(f, 8)
            print(f"     inside one 8-call replay: kernels {' '.join(f'{d:.1f}' for d, _ in k)} us; "
                  f"gaps {' '.join(f'{gap:.1f}' for _, gap in k[1:])} us; median kernel "
                  f"{statistics.median(d for d, _ in k):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

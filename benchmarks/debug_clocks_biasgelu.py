"""Follow-up of debug_graphn_biasgelu.py (2026-11-30 04:07: the erf forward ran 262 us in a
20-call profiler burst but 270-276 us per kernel inside graph replays, replay medians spreading
by up to 40 us, while tanh held 252-257 us every way). Are the SM clocks dropping under the erf
kernel's sustained load? Replays an 8-call graph of each forward for ~3 s, timing each replay with
CUDA events, while nvidia-smi samples SM clock, power and the active clock-throttle reasons every
50 ms. Prints one summary line per activation."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kprof.kernels import bias_gelu as bg  # noqa: E402

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("debug_clocks_biasgelu: needs a CUDA GPU")
    sets = [(torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16),
             torch.randn(16384, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    for approx in ("tanh", "none", "tanh"):
        with torch.no_grad():
            f = [lambda x=x, b=b: bg.bias_gelu(x, b, approximate=approx) for x, b in sets]
            for s in f:
                s()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(8):
                    f[i % 2]()
            g.replay()
            torch.cuda.synchronize()
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                                   stdout=subprocess.PIPE, text=True)
            times, t_end = [], time.time() + 3.0
            while time.time() < t_end:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 8)
            smi.terminate()
            out = smi.communicate()[0]
            rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 3]
            clk = [float(r[0]) for r in rows]
            pw = [float(r[1]) for r in rows if r[1].replace(".", "").isdigit()]
            reasons = sorted({r[3] for r in rows})
            q = statistics.quantiles(times, n=10)
            print(f"{approx:4s} per call: median {statistics.median(times):6.1f} us, p10 {q[0]:6.1f}, p90 {q[-1]:6.1f} "
                  f"({len(times)} replays); SM clock MHz min/median/max {min(clk):.0f}/{statistics.median(clk):.0f}/{max(clk):.0f}; "
                  f"power W median/max {statistics.median(pw):.0f}/{max(pw):.0f}; throttle reasons {reasons}; "
                  f"temp {rows[-1][2]} C", flush=True)
            del g
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Follow-up of debug_graphn_biasgelu.py (2026-11-30 04:07: the erf forward ran 262 us in a
20-call profiler burst but 270-276 us per kernel inside graph replays, replay medians spreading
by up to 40 us, while tanh held 252-257 us every way). Are the SM clocks dropping under the erf
kernel's sustained load? Replays an 8-call graph of each forward for ~3 s, timing each replay with
CUDA events, while nvidia-smi samples SM clock, power and the active clock-throttle reasons every
50 ms. Prints one summary line per activation."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import capture_graph  # noqa: E402
from benchmarks.clocks import sustained  # noqa: E402
from kprof.kernels import bias_gelu as bg  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("debug_clocks_biasgelu: needs a CUDA GPU")
    sets = [(torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16),
             torch.randn(16384, device="cuda", dtype=torch.bfloat16)) for _ in range(2)]
    for approx in ("tanh", "none", "tanh"):
        with torch.no_grad():
            f = [lambda x=x, b=b: bg.bias_gelu(x, b, approximate=approx) for x, b in sets]
            g = capture_graph(f, [], calls=8)
            print(f"{approx:4s} {sustained(g, 8)}", flush=True)
            del g
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

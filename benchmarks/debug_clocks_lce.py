"""Fused linear + cross-entropy at the issue's shape (hidden 8192 x 4096, weight 128256 x 4096,
bf16, fwd+bwd): is the step power-capped, and does kprof's chunked loop pay for its extra DRAM
traffic in clock speed? The 512-row chunk (Liger's memory) streams grad_W (2.1 GB read + written)
and W (twice) once per chunk: ~67 GB a step against ~17 GB at 2048 rows. Each variant is captured
in a CUDA graph (2 steps) and replayed for ~4 s while nvidia-smi samples SM clock and power
(benchmarks/clocks.py). One line per variant."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_kernels import capture_graph  # noqa: E402
from benchmarks.cases.loss import _eager_lce  # noqa: E402
from benchmarks.clocks import sustained  # noqa: E402

_lce = importlib.import_module("kprof.kernels.fused_linear_cross_entropy")


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("debug_clocks_lce: needs a CUDA GPU")
    n, h, v = 8192, 4096, 128256
    hidden = (torch.randn(n, h, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    variants = {
        "kprof chunk 512 grad_into_hidden": functools.partial(_lce.linear_cross_entropy, grad_into_hidden=True),
        "kprof chunk 2048": functools.partial(_lce.linear_cross_entropy, chunk_size=2048),
        "torch.compile": torch.compile(_eager_lce, dynamic=False),
    }
    for name, fn in variants.items():
        def step(fn=fn, into=name.endswith("grad_into_hidden")):
            # grad_into_hidden overwrites a non-leaf copy of hidden, as the LM-head patch's input
            fn(hidden * 1.0 if into else hidden, weight, target).backward()

        g = capture_graph([step], [hidden, weight], calls=2)
        print(f"{name:34s} {sustained(g, 2, seconds=4.0, unit='ms')}", flush=True)
        del g
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

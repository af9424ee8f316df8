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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.clocks import sustained  # noqa: E402

_lce = importlib.import_module("kprof.kernels.fused_linear_cross_entropy")


def _eager(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target, ignore_index=-100)


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
        "torch.compile": torch.compile(_eager, dynamic=False),
    }
    for name, fn in variants.items():
        def step(fn=fn):
            # grad_into_hidden overwrites a non-leaf copy of hidden, as the LM-head patch's input
            x = hidden * 1.0 if "into" in name else hidden
            fn(x, weight, target).backward()
            hidden.grad = None
            weight.grad = None

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
            step()
        print(f"{name:34s} {sustained(g, 2, seconds=4.0, unit='ms')}", flush=True)
        del g
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

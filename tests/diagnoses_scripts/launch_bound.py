"""Planted: a launch-bound step. A deep stack of tiny layers (width 32, batch 4): each forward
layer is 4 small kernels (linear, layer norm, GELU, residual add), the backward about twice as
many, so a step is a few hundred kernels of a few microseconds each, below the time the host
needs to launch one (12.2 us for `x + 1` on the H200 machine,
benchmarks/results/host-overhead-h200-20261129.txt). The GPU idles between them. Fused AdamW and no host sync, so launch overhead is the only problem.

    python launch_bound.py [--device cpu|cuda] [--iters N]
"""

import argparse

import torch
from tiny import iters
from torch import nn

DEPTH, WIDTH, BATCH = 24, 32, 4

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
args = p.parse_known_args()[0]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.norm(self.fc(x)))


torch.manual_seed(0)
m = nn.Sequential(*[Block() for _ in range(DEPTH)]).to(args.device)  # kprof-test: model
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
x = torch.randn(BATCH, WIDTH, device=args.device)
for step in range(iters(8)):
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

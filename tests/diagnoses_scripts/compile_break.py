"""Planted: a compiled model with one graph break (`.item()` in forward) and one recompile (a
Python scalar argument that changes once, at step 2)."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=8)
args = p.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, scale):
        y = self.a(x)
        peak = y.max().item()  # kprof-test: graph-break
        del peak
        return self.b(y) * scale  # kprof-test: recompile


torch.manual_seed(0)
m = torch.compile(Net())
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
x = torch.randn(4, 8)
for step in range(args.iters):
    loss = m(x, 1.0 if step < 2 else 0.5).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

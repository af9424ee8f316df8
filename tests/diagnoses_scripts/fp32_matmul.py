"""Planted (GPU): fp32 matmuls that dominate the step (a 2048-wide MLP, TF32 left off, as
PyTorch's default). `--tf32` turns TF32 on: the same script must then not be flagged."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=8)
p.add_argument("--tf32", action="store_true")
args = p.parse_known_args()[0]
torch.backends.cuda.matmul.allow_tf32 = args.tf32  # kprof-test: tf32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = 2048 if DEVICE == "cuda" else 32  # CPU: only that it runs

torch.manual_seed(0)
m = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)).to(DEVICE)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
x = torch.randn(4096 if DEVICE == "cuda" else 8, WIDTH, device=DEVICE)
for step in range(args.iters):
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

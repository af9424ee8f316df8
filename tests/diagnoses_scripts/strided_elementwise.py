"""Planted (GPU): a RoPE-style rotate-half on non-contiguous halves of the last dimension, which
dominates the step (elementwise ops reading strided views cannot use vector loads). `--contiguous`
makes the halves contiguous first: the strided rows must then be gone."""

import argparse

import torch
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=8)
p.add_argument("--contiguous", action="store_true")
args = p.parse_known_args()[0]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = (8, 2048, 32, 128) if DEVICE == "cuda" else (2, 8, 2, 16)  # CPU: only that it runs


class RotateHalf(nn.Module):
    def __init__(self, contiguous: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(SHAPE[-1], device=DEVICE))
        self.contiguous = contiguous

    def forward(self, x):
        d = x.shape[-1] // 2
        a, b = x[..., :d], x[..., d:]  # views with a row stride of 2 * d
        if self.contiguous:
            a, b = a.contiguous(), b.contiguous()
        return torch.cat((a * b - b, b * a + a), dim=-1) * self.scale


torch.manual_seed(0)
m = RotateHalf(args.contiguous)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randn(*SHAPE, device=DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
for step in range(args.iters):
    loss = m(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

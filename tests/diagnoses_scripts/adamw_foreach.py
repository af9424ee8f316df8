"""Planted: a foreach AdamW (multi-tensor, but one pass over memory per op)."""

import torch
from tiny import batch, iters, model

m = model()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)  # kprof-test: optimizer
for step in range(iters()):
    loss = m(batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

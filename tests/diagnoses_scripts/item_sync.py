"""Planted: the loss read back with .item() every step (a host sync on a GPU); the optimizer is
fused so that the sync is the only problem."""

import torch
from tiny import batch, iters, model

m = model()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
losses = []
for step in range(iters()):
    loss = m(batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())  # kprof-test: item-sync

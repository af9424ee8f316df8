"""Clean: a fused AdamW and no host sync in the loop (no diagnosis may fire)."""

import torch
from tiny import batch, iters, model

m = model()
opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)  # kprof-test: optimizer
for step in range(iters()):
    loss = m(batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

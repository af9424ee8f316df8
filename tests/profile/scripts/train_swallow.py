"""Planted: the whole loop sits in `try/except Exception`, which must not swallow kprof's stop."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(40)
model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
finished = False
try:
    for step in range(args.iters):
        ids, labels = batch(step)
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
    finished = True
except Exception as e:  # the kind of catch-all kprof's stop must get through
    print("swallowed", e)
if not finished:
    raise SystemExit(5)

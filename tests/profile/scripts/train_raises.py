"""Planted: the script fails (--raise-at N) or is interrupted (--interrupt-at N) after N
optimizer steps."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(40)
model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(args.iters):
    ids, labels = batch(step)
    loss = model(ids, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step + 1 == args.raise_at:
        raise ValueError(f"planted failure at step {step}")  # kprof-test: raise
    if step + 1 == args.interrupt_at:
        raise KeyboardInterrupt

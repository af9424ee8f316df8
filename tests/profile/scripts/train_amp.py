"""Planted: mixed-precision style loop with a GradScaler (scaled loss passed to backward)."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(40)
model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler(DEVICE, init_scale=1024.0)
for step in range(args.iters):
    ids, labels = batch(step)
    loss = model(ids, labels)
    scaler.scale(loss).backward()
    scaler.step(opt)  # kprof-test: scaler-step
    scaler.update()
    opt.zero_grad()

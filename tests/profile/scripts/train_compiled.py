"""Planted: the model runs under torch.compile (backend "eager": Dynamo without a C++ compiler,
so it runs on any CPU)."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(30)
model = torch.compile(TinyLM().to(DEVICE), backend="eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(args.iters):
    ids, labels = batch(step)
    loss = model(ids, labels)
    loss.backward()
    opt.step()
    opt.zero_grad()

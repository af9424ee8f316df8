"""Planted: a training loop that reads the loss back every step (a host sync on a GPU), with
the loss computed by a second, separate root module (a criterion)."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv
from torch import nn

args = iters_from_argv(40)
model = TinyLM().to(DEVICE)
crit = nn.CrossEntropyLoss()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
history = []
for step in range(args.iters):
    ids, labels = batch(step)
    logits = model(ids)
    loss = crit(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    history.append(loss.item())  # kprof-test: item-sync

"""Planted: 20 evaluation forwards under no_grad before training starts (nanoGPT evaluates
before its first step). With --optimizer-first the optimizer exists during the evaluation."""

import sys

import torch
from tinylm import DEVICE, TinyLM, batch

model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if "--optimizer-first" in sys.argv else None
with torch.no_grad():
    for i in range(20):
        model(batch(1000 + i)[0])
if opt is None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(30):
    ids, labels = batch(step)
    model(ids, labels).backward()
    opt.step()
    opt.zero_grad()

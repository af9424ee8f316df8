"""Planted: trains a few steps, then sys.exit(0)."""

import sys

import torch
from tinylm import DEVICE, TinyLM, batch

model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(3):
    ids, labels = batch(step)
    model(ids, labels).backward()
    opt.step()
    opt.zero_grad()
sys.exit(0)

"""Planted: no optimizer, an inference loop under no_grad (stepped by the outermost forward)."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(60)
model = TinyLM().to(DEVICE).eval()
with torch.no_grad():
    for step in range(args.iters):
        ids, _ = batch(step)
        logits = model(ids)

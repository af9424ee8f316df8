"""Planted: a plain training loop (AdamW), the model called with keyword arguments."""

import torch
from tinylm import DEVICE, TinyLM, batch, iters_from_argv

args = iters_from_argv(40)
torch.manual_seed(0)
model = TinyLM().to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(args.iters):
    ids, labels = batch(step)
    loss = model(input_ids=ids, labels=labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

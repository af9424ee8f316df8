"""Planted: a slow input pipeline. A DataLoader over a Dataset whose __getitem__ sleeps
(SAMPLE_MS per sample, standing in for decoding/augmentation), in the main process
(num_workers=0), pageable batches and a blocking copy to the device. The model is tiny and the
optimizer fused, so waiting for data is most of the step.

    python slow_loader.py [--device cpu|cuda] [--iters N]
"""

import argparse
import time

import torch
from tiny import model
from torch.utils.data import DataLoader, Dataset

SAMPLE_MS = 2.0  # x 4 samples per batch = 8 ms of loading per step, against ~1 ms of compute
BATCH = 4

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--iters", type=int, default=8)
args = p.parse_known_args()[0]


class SlowDataset(Dataset):
    def __len__(self) -> int:
        return BATCH * args.iters

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(SAMPLE_MS / 1e3)
        return torch.randn(8, generator=torch.Generator().manual_seed(i))


m = model().to(args.device)
opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
loader = DataLoader(SlowDataset(), batch_size=BATCH, num_workers=0)  # kprof-test: loader
for x in loader:
    x = x.to(args.device)  # kprof-test: h2d
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

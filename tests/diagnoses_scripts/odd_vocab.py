"""Planted: an lm-head Linear with GPT-2's vocab of 50257 (= 50257 mod 8 = 1): on tensor cores the
logits matmul and both its gradient matmuls run with a misaligned dimension. nanoGPT pads it to
50304 (a multiple of 64); `--vocab 50304` runs the clean version of the same model.

CPU (default): batch 2 x 32 tokens, hidden 64 (a step is a few ms). `--device cuda --dtype
bfloat16`: batch 8 x 1024 tokens, hidden 768 (GPT-2 small's width), where the lm-head dominates.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--dtype", default="float32")
p.add_argument("--iters", type=int, default=6)
p.add_argument("--vocab", type=int, default=50257)  # kprof-test: vocab
args = p.parse_known_args()[0]
DEVICE, DTYPE = torch.device(args.device), getattr(torch, args.dtype)
B, T, C = (8, 1024, 768) if DEVICE.type == "cuda" else (2, 32, 64)


class LM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, C)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.lm_head = nn.Linear(C, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        return self.lm_head(x + self.mlp(x))


torch.manual_seed(0)
model = LM(args.vocab).to(DEVICE, DTYPE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
g = torch.Generator().manual_seed(0)
for step in range(args.iters):
    idx = torch.randint(0, 50257, (B, T + 1), generator=g).to(DEVICE)  # GPT-2 token ids
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, args.vocab), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

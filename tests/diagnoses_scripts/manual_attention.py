"""Planted: causal self-attention written out by hand (q @ k^T * scale, masked_fill, softmax, @ v)
inline in a forward that no kernel rule recognises: the projections are raw Parameters, not
nn.Linear children, so rules/attention.py's profile patterns (which need 1-2 or >= 3 matmul
children) don't match and only the manual_attention diagnosis can point at it.

CPU (default): 2 layers, batch 2, 2 heads x 16, 64 tokens (only that it runs). `--device cuda
--dtype bfloat16`: 2 layers, batch 4, 16 heads x 64, 2048 tokens, where the T x T scores cost.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--dtype", default="float32")
p.add_argument("--iters", type=int, default=6)
args = p.parse_known_args()[0]
DEVICE, DTYPE = torch.device(args.device), getattr(torch, args.dtype)
GPU = DEVICE.type == "cuda"
B, T, HEADS, HEAD_DIM, VOCAB, LAYERS = (4, 2048, 16, 64, 4096, 2) if GPU else (2, 64, 2, 16, 64, 2)
C = HEADS * HEAD_DIM


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_qkv = nn.Parameter(torch.randn(C, 3 * C) / math.sqrt(C))
        self.w_out = nn.Parameter(torch.randn(C, C) / math.sqrt(C))
        self.register_buffer("causal", torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (x @ self.w_qkv).split(c, dim=-1)
        q, k, v = (z.view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for z in (q, k, v))  # (b, heads, t, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HEAD_DIM))  # kprof-test: scores
        att = att.masked_fill(~self.causal[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)  # kprof-test: softmax
        y = att @ v
        return y.transpose(1, 2).reshape(b, t, c) @ self.w_out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


torch.manual_seed(0)
model = LM().to(DEVICE, DTYPE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
g = torch.Generator().manual_seed(0)
for step in range(args.iters):
    idx = torch.randint(0, VOCAB, (B, T + 1), generator=g).to(DEVICE)
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.float().view(-1, VOCAB), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

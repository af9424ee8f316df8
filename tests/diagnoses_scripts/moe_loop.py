"""Planted: a hand-written MoE (router Linear -> softmax -> topk -> ModuleList of SwiGLU experts)
dispatched by a Python loop over the experts, with the host syncs of that style (torch.where
with one argument, boolean-mask indexing, `if rows.numel()`), and a router biased to expert 0
(top-2 of 8: expert 0 takes nearly every token, ~4x the mean load)."""

import torch
import torch.nn.functional as F
from tiny import DEVICE, iters
from torch import nn

DIM, EXPERTS, TOP_K, TOKENS = 32, 8, 2, 64


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 48, bias=False)
        self.w3 = nn.Linear(DIM, 48, bias=False)
        self.w2 = nn.Linear(48, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        with torch.no_grad():
            self.router.bias[0] = 4.0  # kprof-test: imbalance
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(TOP_K, dim=-1)  # kprof-test: topk
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)  # kprof-test: where-sync
            if rows.numel() == 0:
                continue
            picked = w[idx == e]  # kprof-test: mask-sync
            out.index_add_(0, rows, expert(x[rows]) * picked[:, None])
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = nn.ModuleList(MoE() for _ in range(2))

    def forward(self, x):
        x = self.inp(x)
        for m in self.moe:
            x = x + m(x)
        return x


torch.manual_seed(0)
net = Net().to(DEVICE)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
for step in range(iters()):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(TOKENS, DIM, generator=g).to(DEVICE)
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

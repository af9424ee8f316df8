"""Planted: module patterns that stress attribution. A shared (tied) layer called twice per
forward, a module built inside forward (never registered), a child whose forward raises and is
caught by its parent, a recursive module, and a user hook that raises on some calls."""

import torch
from torch import nn


class Flaky(nn.Module):
    def forward(self, x):
        raise RuntimeError("flaky child")


class Recursive(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.depth = depth
        self.lin = nn.Linear(8, 8)

    def forward(self, x, level=0):
        x = self.lin(x)
        return self(x, level + 1) if level + 1 < self.depth else x


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.flaky = Flaky()
        self.rec = Recursive(3)

    def forward(self, x):
        x = self.shared(self.shared(x))  # the same module twice
        x = nn.Tanh()(x)  # built on the fly: not in named_modules()
        try:
            x = self.flaky(x)
        except RuntimeError:
            pass
        return self.rec(x)


model = Odd()
calls = {"n": 0}


def sometimes_raises(module, args):
    calls["n"] += 1
    if calls["n"] % 3 == 0:
        raise ValueError("user hook failed")


model.shared.register_forward_pre_hook(sometimes_raises)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    try:
        loss = model(torch.randn(2, 8)).square().mean()
    except ValueError:
        continue  # the user's hook failed: skip the step (no optimizer step)
    loss.backward()
    opt.step()
    opt.zero_grad()

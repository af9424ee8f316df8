"""Planted: the loss module is built anew every step (`nn.CrossEntropyLoss()(...)`): a new root
object each step that must keep one stable path."""

import torch
from torch import nn

model = nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(14):
    x = torch.randn(2, 4)
    loss = nn.CrossEntropyLoss()(model(x), torch.tensor([0, 2]))
    loss.backward()
    opt.step()
    opt.zero_grad()

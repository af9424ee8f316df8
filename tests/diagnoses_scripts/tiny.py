"""A tiny MLP and batch shared by the diagnoses' planted scripts (CPU: a step takes milliseconds)."""

import argparse

import torch
from torch import nn

# `--device cuda` for the GPU tests; the CPU default keeps the CPU tests CPU runs on a GPU machine
# too (H200, 2026-11-29: an auto-picked cuda turned a CPU test's planted sync into a measured one).
_p = argparse.ArgumentParser()
_p.add_argument("--device", default="cpu")
DEVICE = _p.parse_known_args()[0].device


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEVICE)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g).to(DEVICE)


def iters(default: int = 6) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=default)
    return p.parse_known_args()[0].iters

"""The small fp32 MLP of issue 19 item 3: 12 x (Linear(256, 256) + ReLU), batch 32, Adam, a
mean-squared loss, static shapes. Each step is ~100 tiny kernels, so the GPU waits on the host's
launches: the launch-bound step the `cuda_graphs` patch is for. The end-to-end GPU check:

    kprof profile benchmarks/workloads/mlp_cuda_graphs.py
    kprof apply --patch cuda_graphs benchmarks/workloads/mlp_cuda_graphs.py

    python benchmarks/workloads/mlp_cuda_graphs.py [--steps 600] [--device cuda|cpu]
"""

import argparse

import torch
from torch import nn

DEPTH, WIDTH, BATCH = 12, 256, 32


def mlp() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The one (input, target) pair every step trains on: seeded, so every variant sees the same."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g).to(device), torch.randn(BATCH, WIDTH, generator=g).to(device)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


if __name__ == "__main__":  # benchmarks/bench_cuda_graphs.py imports the model and the step
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    torch.manual_seed(0)
    model = mlp().to(args.device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = batch(args.device)
    for _ in range(args.steps):
        train_step(model, opt, x, y)

"""A tiny language model shared by the planted test scripts (imported from the script's folder,
which also checks that kprof puts that folder on sys.path like `python script.py` does)."""

import torch
from torch import nn

VOCAB, DIM, BATCH, SEQ = 64, 16, 4, 8  # tokens per step = BATCH * SEQ = 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mlp = MLP(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.mlp(self.embed(input_ids)))  # (B, T, VOCAB)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(DEVICE)
    return ids, ids.roll(-1, dims=1)


def iters_from_argv(default: int) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=default)
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--interrupt-at", type=int, default=-1)
    return p.parse_known_args()[0]

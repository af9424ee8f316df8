"""A tiny Hugging Face MoE causal LM trained a few steps (`--arch mixtral|qwen2_moe|olmoe|
deepseek_v3`, tests/moe_models.py's configs): eager experts use torch._grouped_mm; `--experts
eager` picks transformers' per-expert loop instead."""

import argparse
import sys
from pathlib import Path

import torch
from tiny import DEVICE, iters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import hf_model  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--arch", default="mixtral")
p.add_argument("--experts", default=None, help="config._experts_implementation (eager: a loop)")
args = p.parse_known_args()[0]

model = hf_model(args.arch).to(DEVICE)
if args.experts:
    model.config._experts_implementation = args.experts
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
for step in range(iters()):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 128, (2, 32), generator=g).to(DEVICE)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

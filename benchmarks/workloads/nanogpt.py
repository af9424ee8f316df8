"""The nanoGPT-style GPT of issue 20: examples/gpt_train.py's model (hand-written attention with a
`tril` mask buffer, masked_fill + softmax, GELU MLP, tied head, F.cross_entropy inside forward) at
12 layers, d 1024, 16 heads, vocab 50304, batch 8 x 1024, bf16 autocast over fp32 weights and a
foreach AdamW (H200, 2026-12-01: kprof apply 83.1 -> 81.7 ms, SDPA and linear + CE not installed).

    python benchmarks/workloads/nanogpt.py [--steps 200] [--batch-size 8] [--seq-len 1024]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt_train import GPT, GPTConfig  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=1024)
p.add_argument("--n-layer", type=int, default=12)
p.add_argument("--n-embd", type=int, default=1024)
p.add_argument("--n-head", type=int, default=16)
p.add_argument("--vocab", type=int, default=50304)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()

torch.manual_seed(0)
cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                n_embd=args.n_embd)
model = GPT(cfg).to(args.device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
data = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=args.device)
x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
for step in range(args.steps):
    with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

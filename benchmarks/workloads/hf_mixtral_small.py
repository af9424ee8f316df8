"""A small Hugging Face Mixtral (mixture of experts) trained the usual way, random weights.

    python benchmarks/workloads/hf_mixtral_small.py [--steps 200] [--batch-size 8] [--seq-len 1024]

The issue-18 workload: 8 layers, hidden 1024, 8 experts top-2, batch 8 x 1024, bf16 weights,
fused AdamW (H200, 2026-12-01: `apply --patch all` took eager's 60.6 ms to 69.4 ms). The issue
does not give the rest; here: intermediate 2048 per expert, 16 heads / 8 KV heads, vocab 32000.
"""

import argparse

import torch
from transformers import MixtralConfig, MixtralForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq-len", type=int, default=1024)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()

torch.manual_seed(0)
config = MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=args.seq_len, attn_implementation="sdpa")
model = MixtralForCausalLM(config).to(args.device, torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=args.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

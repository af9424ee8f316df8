"""A ~150M-parameter Hugging Face Llama trained the usual way, random weights (no download).

    python benchmarks/workloads/hf_llama_150m.py [--steps 200] [--batch-size 16] [--seq-len 1024]

The issue-18 workload: hidden 768, 12 layers, 12 heads / 4 KV heads, intermediate 2048, vocab
32000, bf16 weights, fused AdamW, batch 16 x 1024 (H200, 2026-12-01: eager 54.4 ms/step).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--seq-len", type=int, default=1024)
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = p.parse_args()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                     num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=args.seq_len,
                     attn_implementation="sdpa")
model = LlamaForCausalLM(config).to(args.device, torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len), device=args.device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

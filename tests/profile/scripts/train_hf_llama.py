"""Planted: a tiny Hugging Face Llama trained the usual way (`model(input_ids=..., labels=...)`)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = LlamaForCausalLM(config).to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(30):
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()

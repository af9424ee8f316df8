"""Train a Hugging Face LlamaForCausalLM on random tokens: kprof's realistic example.

The model is built from a LlamaConfig (random init, nothing downloaded), so it runs offline.
Presets are a plain dict; `tiny` runs on a CPU in seconds, `1b` is the GPU workload kprof's
kernels are measured on (Llama-3-shaped: GQA 32/8 heads, vocab 128256, 8 layers so one H200 holds
weights, grads, AdamW state and activations of a 4 x 2048-token batch without checkpointing).

    python examples/llama_train.py --preset tiny
    kprof profile examples/llama_train.py -- --preset 1b --device cuda
    kprof apply examples/llama_train.py -- --preset 1b --device cuda --compile   # patches vs compile alone
"""

from __future__ import annotations

import argparse
import inspect

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PRESETS = {
    "tiny": dict(
        model=dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        batch_size=4, seq_len=64, dtype="float32",
    ),
    # ~1.0B parameters: 8 x 60.8M per layer + 2 x 262.7M (untied embedding and lm head).
    "1b": dict(
        model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                   rope_theta=500000.0),  # Llama 3's RoPE base
        batch_size=4, seq_len=2048, dtype="bfloat16",
    ),
}


def build_model(preset: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = LlamaConfig(**PRESETS[preset]["model"], attn_implementation="sdpa")
    # Weights in the training dtype (pure bf16 on the GPU, as Liger's and most kernel benchmarks
    # run): no autocast casts in the profile, so every op runs on the dtype the kernels target.
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    # 200: `kprof apply`'s ablation times up to 21 blocks of every patch configuration (126 steps
    # for the 1B's four groups) before it stops the script; kprof profile stops it after 15.
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight and compute dtype; default: the preset's")
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--checkpoint-every-layer", action="store_true",
                   help="Hugging Face's gradient checkpointing on every decoder layer (the usual memory fix, "
                        "to compare with the layers kprof picks)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (default mode, Inductor): `kprof apply` then times its patches "
                        "under this compile, against compile alone")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or preset["dtype"])
    batch_size = args.batch_size or preset["batch_size"]
    seq_len = args.seq_len or preset["seq_len"]
    torch.manual_seed(0)

    model = build_model(args.preset, device, dtype)
    model.train()
    if args.checkpoint_every_layer:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.compile:
        model = torch.compile(model)  # parameters and config reached through the wrapper
    # fused=True: AdamW in one multi-tensor kernel per step (CUDA and CPU); probe, don't version-check.
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {}))

    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)  # (B, T)

    for step in range(args.steps):
        # HF shifts labels inside the loss, so labels = input_ids.
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            # Deliberate host sync (.item() waits for the device); kprof reports it with this line.
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

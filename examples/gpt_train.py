"""A small GPT trained on random tokens: the example kprof profiles in the README.

nanoGPT-shaped (token + position embedding, pre-LayerNorm blocks, weight-tied lm head) and written
in plain PyTorch. Attention is spelled out by hand (q @ k.T * scale, causal masked_fill, softmax,
@ v) instead of calling scaled_dot_product_attention, on purpose: that is the unfused pattern
`kprof suggest` looks for. The MLP is Linear -> GELU(tanh) -> Linear for the same reason.

    python examples/gpt_train.py                      # CPU defaults, a few seconds
    kprof profile examples/gpt_train.py               # the same, under kprof
    kprof profile examples/gpt_train.py -- --device cuda --dtype bfloat16 --batch-size 16 --seq-len 1024
"""

from __future__ import annotations

import argparse
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    # CPU-sized defaults: 13 steps (kprof's default 3 warmup + 5 timed + 5 recorded) take a few
    # seconds on 2 CPU cores, profiler included.
    vocab_size: int = 512
    block_size: int = 128  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps runs comparable step to step (no random masks)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        # Unfused on purpose (see the module docstring): materialises the (B, nh, T, T) scores
        # three times (matmul, mask, softmax) where a flash-attention kernel keeps them on chip.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        att = att.masked_fill(~self.causal[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # GPT-2's init: N(0, 0.02) weights, zero biases.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype for forward/backward (weights and optimizer stay fp32)")
    p.add_argument("--n-layer", type=int, default=GPTConfig.n_layer)
    p.add_argument("--n-embd", type=int, default=GPTConfig.n_embd)
    p.add_argument("--n-head", type=int, default=GPTConfig.n_head)
    p.add_argument("--log-every", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    block_size=max(args.seq_len, GPTConfig.block_size))
    model = GPT(cfg).to(device)
    # fused=True: one multi-tensor kernel per step, and no per-parameter `step.item()` on the host
    # (the foreach/for-loop AdamW reads each step counter with .item()). Probe, don't version-check.
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, **({"fused": True} if fused else {}))
    # fp16 needs loss scaling; bf16 and fp32 don't.
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    use_autocast = dtype != torch.float32

    # Random tokens, made once up front so the loop does no host work: the point is the model's
    # compute, not data loading.
    data = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # (B, T) inputs and next-token targets

    for step in range(args.steps):
        with torch.autocast(device.type, dtype=dtype, enabled=use_autocast):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if step % args.log_every == 0 or step == args.steps - 1:
            # Deliberate host sync: .item() waits for the GPU to finish the step before Python can
            # queue the next one. `kprof profile` reports it under "host syncs" with this line.
            # Logging every --log-every steps keeps the stall rare; a real loop would log less often
            # or accumulate the loss on the device.
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

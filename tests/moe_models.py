"""Tiny mixture-of-experts models for the MoE tests: Hugging Face blocks built from configs
(nothing downloaded) and hand-written ones, plus a dense gated MLP that is not an MoE."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 32


def hf_model(arch: str) -> nn.Module:
    """A 2-layer causal LM of `arch` at hidden 32 (CPU: milliseconds a step)."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **common)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=64,
                                num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, **common)
    elif arch == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=16, num_experts=8, num_experts_per_tok=2, **common)
    elif arch == "deepseek_v3":
        # Layer 0 dense (first_k_dense_replace=1): a gated MLP beside the MoE, which must not match.
        cfg = tf.DeepseekV3Config(intermediate_size=64, moe_intermediate_size=16, n_routed_experts=8,
                                  num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                                  first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common)
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Router Linear -> softmax -> topk -> a ModuleList of SwiGLU experts, dispatched by a Python
    loop with torch.where and index_add_ (the issue's hand-written case)."""

    def __init__(self, dim: int = HIDDEN, n_experts: int = 6, k: int = 2, hidden: int = 48):
        super().__init__()
        self.k = k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(n_experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.router(x).softmax(-1).topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = self.kept(*torch.where(idx == e))
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * w[rows, slot, None])
        return out.reshape(shape)

    def kept(self, rows, slot):
        """The (token, choice) pairs an expert takes: all of them (a capacity factor drops some)."""
        return rows, slot


class DenseMaskMoE(nn.Module):
    """Stacked expert weights [E, H, I] applied to every token with one einsum, the top-k picked
    by a mask; sigmoid scores, top-k taken before the score (logits), weights from a bare
    Parameter router: structure unlike LoopMoE's in every respect."""

    def __init__(self, dim: int = HIDDEN, n_experts: int = 4, k: int = 1, hidden: int = 16):
        super().__init__()
        self.k = k
        self.gate_w = nn.Parameter(torch.randn(n_experts, dim) * 0.1)
        self.w_in = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.1)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, dim) * 0.1)

    def forward(self, x):
        scores = torch.sigmoid(x @ self.gate_w.t())
        top, idx = torch.topk(scores, self.k, dim=-1)
        mask = torch.zeros_like(scores).scatter(-1, idx, top)
        h = F.gelu(torch.einsum("...d,edh->...eh", x, self.w_in))
        y = torch.einsum("...eh,ehd->...ed", h, self.w_out)
        return (y * mask.unsqueeze(-1)).sum(-2)


class GatedMLP(nn.Module):
    """Dense SwiGLU: three Linears, no router, no top-k. Not an MoE."""

    def __init__(self, dim: int = HIDDEN, hidden: int = 64):
        super().__init__()
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x):
        return self.mlp(x)


class MixtureNoTopK(nn.Module):
    """Experts and a router but every expert weighted by softmax (a soft mixture): no top-k,
    so not a routed MoE."""

    def __init__(self, dim: int = HIDDEN, n_experts: int = 3):
        super().__init__()
        self.router = nn.Linear(dim, n_experts)
        self.experts = nn.ModuleList(SwiGLU(dim, 16) for _ in range(n_experts))

    def forward(self, x):
        p = self.router(x).softmax(-1)
        return sum(p[..., e, None] * ex(x) for e, ex in enumerate(self.experts))

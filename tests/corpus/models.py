"""Model styles as people write them, tiny: each style is a model, a batch, its loss as the user's
training step computes it, the optimizer it uses, and the rule classes its source contains.

`EXPECTED` is written from each model's source (which patterns its code holds), not from what
kprof reports. `GAPS` lists rule classes a style's source holds that kprof cannot install yet;
tests/corpus/test_corpus.py checks those are still missing (so the list is kept honest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H, NH, KVH, I, T, B = 96, 32, 4, 2, 80, 8, 2  # I != V: no MLP projection looks like a head


# ---------------------------------------------------------------------------------------------
# nanoGPT (karpathy/nanoGPT model.py, trimmed): tril buffer + masked_fill + softmax attention,
# nn.GELU MLP, LayerNorm modules, tied head, F.cross_entropy(logits.view(-1, V), y) in forward.


class NanoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(H, 3 * H)
        self.c_proj = nn.Linear(H, H)
        self.attn_dropout = nn.Dropout(0.0)
        self.n_head = NH
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def forward(self, x):
        Bx, Tx, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(Bx, Tx, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(Bx, Tx, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(Bx, Tx, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :Tx, :Tx] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(Bx, Tx, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(H, 4 * H)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * H, H)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(H), NanoAttention(), nn.LayerNorm(H), NanoMLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_layer=1):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, H), wpe=nn.Embedding(16, H),
                                              h=nn.ModuleList([NanoBlock() for _ in range(n_layer)]),
                                              ln_f=nn.LayerNorm(H)))
        self.lm_head = nn.Linear(H, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= 16
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# ---------------------------------------------------------------------------------------------
# minGPT-like with einsum: a 2-D tril mask buffer, (B, T, nh, hs) einsums, a NewGELU written out with tanh in an
# nn.Sequential MLP, an untied head, logits returned and the loss computed in the training loop.


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class EinsumAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, H)
        self.heads = NH
        self.register_buffer("mask", torch.tril(torch.ones(16, 16)))

    def forward(self, x):
        Bx, Tx, C = x.shape
        q, k, v = self.qkv(x).view(Bx, Tx, 3, self.heads, C // self.heads).unbind(2)  # (B, T, nh, hs)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // self.heads)
        s = s.masked_fill(self.mask[:Tx, :Tx] == 0, float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", s.softmax(dim=-1), v)
        return self.out(y.reshape(Bx, Tx, C))


class MinBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = EinsumAttention()
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), NewGELU(), nn.Linear(4 * H, H))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MinGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, H)
        self.pos = nn.Parameter(torch.zeros(1, 16, H))
        self.blocks = nn.ModuleList([MinBlock()])
        self.ln_f = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------------------------------
# A from-scratch Llama: rmsnorm and swiglu as plain functions over nn.Parameter gains, separate
# wq/wk/wv/wo, GQA by repeat_interleave, einsum attention with an additive causal mask built per
# call, logits returned, nn.CrossEntropyLoss outside, Adam(foreach=False).


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu(g, u):
    return F.silu(g) * u


class ScratchAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = H // NH
        self.wq = nn.Linear(H, NH * self.hd, bias=False)
        self.wk = nn.Linear(H, KVH * self.hd, bias=False)
        self.wv = nn.Linear(H, KVH * self.hd, bias=False)
        self.wo = nn.Linear(NH * self.hd, H, bias=False)

    def forward(self, x):
        Bx, Tx, _ = x.shape
        q = self.wq(x).view(Bx, Tx, NH, self.hd).transpose(1, 2)
        k = self.wk(x).view(Bx, Tx, KVH, self.hd).transpose(1, 2).repeat_interleave(NH // KVH, dim=1)
        v = self.wv(x).view(Bx, Tx, KVH, self.hd).transpose(1, 2).repeat_interleave(NH // KVH, dim=1)
        scores = torch.einsum("bhid,bhjd->bhij", q * self.hd ** -0.5, k)
        mask = torch.full((Tx, Tx), float("-inf"), device=x.device).triu(1)
        probs = torch.softmax((scores + mask).float(), dim=-1).type_as(q)
        y = torch.einsum("bhij,bhjd->bhid", probs, v)
        return self.wo(y.transpose(1, 2).reshape(Bx, Tx, -1))


class ScratchFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class ScratchBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_gain, self.ffn_gain = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        self.attn, self.ffn = ScratchAttention(), ScratchFFN()
        self.eps = 1e-5

    def forward(self, x):
        x = x + self.attn(rmsnorm(x, self.attn_gain, self.eps))
        return x + self.ffn(rmsnorm(x, self.ffn_gain, self.eps))


class ScratchLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList([ScratchBlock()])
        self.out_gain = nn.Parameter(torch.ones(H))
        self.out = nn.Linear(H, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(rmsnorm(x, self.out_gain, 1e-5))


# ---------------------------------------------------------------------------------------------
# torchtitan-style Llama: nn.RMSNorm, w1/w2/w3 FeedForward, SDPA already, complex (interleaved)
# RoPE, an output Linear, cross-entropy on logits.flatten(0, 1) in the training loop.


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * fc).flatten(3).type_as(xq), torch.view_as_real(xk_ * fc).flatten(3).type_as(xk))


class TitanAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = H // NH
        self.wq, self.wk = nn.Linear(H, H, bias=False), nn.Linear(H, KVH * self.hd, bias=False)
        self.wv, self.wo = nn.Linear(H, KVH * self.hd, bias=False), nn.Linear(H, H, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, NH, self.hd)
        xk = self.wk(x).view(bs, seqlen, KVH, self.hd)
        xv = self.wv(x).view(bs, seqlen, KVH, self.hd)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))
        y = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(), TitanFFN()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(H), nn.RMSNorm(H)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, H)
        self.register_buffer("freqs_cis", precompute_freqs_cis(H // NH, 16), persistent=False)
        self.layers = nn.ModuleDict({"0": TitanBlock()})
        self.norm = nn.RMSNorm(H)
        self.output = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        fc = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, fc)
        return self.output(self.norm(h))


# ---------------------------------------------------------------------------------------------
# nn.TransformerEncoderLayer (pre-norm, GELU, batch_first), a masked-LM-style head.


class TorchEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        layer = nn.TransformerEncoderLayer(H, NH, dim_feedforward=4 * H, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(H, V)

    def forward(self, idx):
        return self.head(self.encoder(self.emb(idx)))


# ---------------------------------------------------------------------------------------------
# Hugging Face models from configs (no downloads)


def _hf(name: str):
    import transformers as tf

    common = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                  num_attention_heads=NH, num_key_value_heads=KVH, max_position_embeddings=64)
    if name == "hf_llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "hf_mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    if name == "hf_qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if name == "hf_gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**common, head_dim=H // NH))
    if name == "hf_phi3":
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0))
    if name == "hf_gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=1, n_head=NH, n_positions=64,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "hf_neox":
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=V, hidden_size=H, intermediate_size=I,
                                                      num_hidden_layers=1, num_attention_heads=NH,
                                                      max_position_embeddings=64, hidden_dropout=0.0,
                                                      attention_dropout=0.0))
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------
# Styles


@dataclass
class Style:
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # the user's training-step loss
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    slow: bool = False


def _ce_outside(model, x):
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def _ce_module_outside(model, x):
    logits = model(x[:, :-1])
    return nn.CrossEntropyLoss()(logits.reshape(-1, V), x[:, 1:].reshape(-1))


def _ce_flatten(model, x):
    pred = model(x[:, :-1])
    return F.cross_entropy(pred.flatten(0, 1), x[:, 1:].flatten(0, 1))


def _hf_loss(model, x):
    return model(input_ids=x, labels=x).loss


def _nano_loss(model, x):
    return model(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1]


STYLES: dict[str, Style] = {
    "nanogpt": Style(NanoGPT, _nano_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)),
    # slow: every rule class the styles marked slow hold is installed by a fast style too
    # (nanogpt, scratch_llama, torchtitan_llama, hf_llama)
    "mingpt_einsum": Style(MinGPT, _ce_outside, slow=True),
    "scratch_llama": Style(ScratchLlama, _ce_module_outside,
                           lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, foreach=False)),
    "torchtitan_llama": Style(TitanLlama, _ce_flatten, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
    "torch_encoder": Style(TorchEncoder, _ce_outside,
                           lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, foreach=False), slow=True),
    "hf_llama": Style(lambda: _hf("hf_llama"), _hf_loss),
    "hf_mistral": Style(lambda: _hf("hf_mistral"), _hf_loss, slow=True),
    "hf_qwen2": Style(lambda: _hf("hf_qwen2"), _hf_loss, slow=True),
    "hf_gemma": Style(lambda: _hf("hf_gemma"), _hf_loss, slow=True),
    "hf_phi3": Style(lambda: _hf("hf_phi3"), _hf_loss, slow=True),
    "hf_gpt2": Style(lambda: _hf("hf_gpt2"), _hf_loss, slow=True),
    "hf_neox": Style(lambda: _hf("hf_neox"), _hf_loss, slow=True),
}

# Rule classes each style's source holds, from reading the code above and transformers' modeling
# files (transformers 5.x builds attention with SDPA by default: no hand-written attention there).
_LLAMA_HF = {"rms_norm", "gated_mlp", "rope", "linear_cross_entropy"}
EXPECTED: dict[str, set[str]] = {
    "nanogpt": {"layer_norm", "attention_sdpa", "linear_gelu", "linear_cross_entropy", "fused_optimizer"},
    "mingpt_einsum": {"layer_norm", "attention_sdpa", "linear_gelu", "linear_cross_entropy"},
    # rmsnorm() in blocks and at the top: inline_fx; swiglu() inside a 3-Linear FFN: gated_mlp
    "scratch_llama": {"inline_fx", "attention_sdpa", "gated_mlp", "linear_cross_entropy", "fused_optimizer"},
    "torchtitan_llama": {"rms_norm", "gated_mlp", "rope", "linear_cross_entropy", "fused_optimizer"},
    # LayerNorm modules; F.gelu(linear1(x)) inside TransformerEncoderLayer._ff_block: inline_fx
    "torch_encoder": {"layer_norm", "inline_fx", "linear_cross_entropy", "fused_optimizer"},
    "hf_llama": _LLAMA_HF,
    "hf_mistral": _LLAMA_HF,
    "hf_qwen2": _LLAMA_HF,
    "hf_gemma": _LLAMA_HF,
    # Phi3MLP: one gate_up Linear, chunk(2), act(gate) * up -> the traced GLU (inline_fx)
    "hf_phi3": {"rms_norm", "inline_fx", "rope", "linear_cross_entropy"},
    "hf_gpt2": {"layer_norm", "linear_gelu", "linear_cross_entropy"},
    # GPT-NeoX rotates a quarter of each head (rotary_pct 0.25): the kernel's partial rotary
    "hf_neox": {"layer_norm", "linear_gelu", "rope", "linear_cross_entropy"},
}

# In the source, not installable by kprof yet (the corpus test checks each is still missing).
GAPS: dict[str, set[str]] = {}

# In the source and installed, but every call takes the original code (nothing fused yet).
UNFUSED: dict[str, set[str]] = {}

"""Cross-entropy after a large-vocabulary lm head -> fused linear + cross-entropy.

Eager materialises the (B*T, V) logits (bf16, then an fp32 copy for the loss), their log-softmax
and their gradient: at B*T = 8192, V = 128256 that is 2.1 GB of bf16 logits plus 4.2 GB fp32 per
copy, the largest activation of a Llama-3 step. The fused kernel streams the vocabulary in chunks,
computing loss and the hidden/weight gradients without ever holding full logits. The patched
model therefore returns no logits when it computes a loss (`logits` is None): code that reads
logits during training must keep the original path (don't apply this rule).

Two structures, both patched at the top-level forward and verified on the loss and the gradients:
- Hugging Face `*ForCausalLM`: an `lm_head` Linear with `config.vocab_size` outputs and a base
  model at `base_model_prefix`; with `labels`, run the base model, then the fused loss on labels
  shifted as HF's ForCausalLMLoss does (pad with ignore_index, shift by one; mean over non-ignored
  tokens, or sum / num_items_in_batch when given). Without labels the original forward runs.
- nanoGPT-shaped models (`transformer` ModuleDict with wte, wpe, h, ln_f, and `lm_head`) called as
  `model(idx, targets)`: returns (None, loss).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules.engine import ProfilePattern, Rule, kernel_fn

KERNEL = "fused_linear_cross_entropy:linear_cross_entropy"
IGNORE = -100  # HF's and F.cross_entropy's default ignore_index


def _hf_causal_lm(m: nn.Module) -> bool:
    cfg, head = getattr(m, "config", None), getattr(m, "lm_head", None)
    prefix = getattr(m, "base_model_prefix", None)
    return (isinstance(head, nn.Linear) and cfg is not None and getattr(cfg, "vocab_size", None) == head.out_features
            and isinstance(prefix, str) and isinstance(getattr(m, prefix, None), nn.Module))


def _nanogpt(m: nn.Module) -> bool:
    t, head = getattr(m, "transformer", None), getattr(m, "lm_head", None)
    if not isinstance(t, nn.ModuleDict) or not isinstance(head, nn.Linear):
        return False
    params = list(inspect.signature(type(m).forward).parameters)
    return {"wte", "wpe", "h", "ln_f"} <= set(t.keys()) and len(params) >= 3


def match(path: str, m: nn.Module) -> dict | None:
    if path != "":
        return None  # the loss is computed by the top-level module
    if _hf_causal_lm(m):
        return {"kind": "hf"}
    if _nanogpt(m):
        return {"kind": "nanogpt"}
    return None


def _loss(fused, hidden, weight, bias, target, *, num_items=None, softcap=None, grad_into_hidden=False):
    # `fused` is looked up once when the patch is built: a lookup per call (importlib) is a
    # graph break under torch.compile (found by `kprof apply --compare`, 2026-11-29).
    loss = fused(hidden, weight, target, bias, ignore_index=IGNORE, softcap=softcap,
                 reduction="sum" if num_items is not None else "mean", grad_into_hidden=grad_into_hidden)
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _hf_forward(m: nn.Module):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(m).forward
    sig = inspect.signature(original)
    base = getattr(m, m.base_model_prefix)
    fused = kernel_fn(KERNEL)
    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}

    def forward(*args, **kwargs):
        bound = sig.bind(m, *args, **kwargs)
        a = dict(bound.arguments)
        a.pop("self", None)
        extra = a.pop("kwargs", {}) or {}
        labels = a.pop("labels", None)
        keep = a.pop("logits_to_keep", 0)
        if labels is None or not (isinstance(keep, int) and keep == 0) or extra.get("shift_labels") is not None:
            return original(m, *args, **kwargs)
        num_items = extra.pop("num_items_in_batch", None)
        a.pop("return_dict", None)
        out = base(**a, **extra)
        hidden = out[0]  # (B, T, H)
        # ForCausalLMLoss: pad labels with ignore_index on the right, then shift left by one.
        target = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].contiguous()  # (B, T)
        # The final norm's output is read by nothing after the loss unless the caller asked for
        # the hidden states back: then the loss must not write its grad over it.
        wants_hidden = a.get("output_hidden_states")
        wants_hidden = m.config.output_hidden_states if wants_hidden is None else wants_hidden
        loss = _loss(fused, hidden.reshape(-1, hidden.shape[-1]), m.lm_head.weight, m.lm_head.bias,
                     target.reshape(-1).to(hidden.device), num_items=num_items,
                     softcap=getattr(m.config, "final_logit_softcapping", None),  # Gemma 2's tanh cap
                     grad_into_hidden=not wants_hidden)
        rest = {k: v for k, v in out.items() if k in fields and k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)

    return forward


def _nanogpt_forward(m: nn.Module):
    original = type(m).forward
    fused = kernel_fn(KERNEL)

    def forward(idx, targets=None):
        if targets is None:
            return original(m, idx, targets)
        t = m.transformer
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = t.wte(idx) + t.wpe(pos)  # (B, T, C)
        if "drop" in t:
            x = t.drop(x)
        for block in t.h:
            x = block(x)
        x = t.ln_f(x)
        loss = _loss(fused, x.reshape(B * T, -1), m.lm_head.weight, m.lm_head.bias, targets.reshape(-1),
                     grad_into_hidden=True)  # ln_f's output: read by nothing after the loss
        return None, loss

    return forward


def replace(m: nn.Module, p: dict) -> dict:
    return {"": _hf_forward(m) if p["kind"] == "hf" else _nanogpt_forward(m)}


def loss_output(out):
    """Verification compares the loss only: the patched model returns no logits by design."""
    if isinstance(out, tuple) and len(out) == 2 and not hasattr(out, "loss"):
        return out[1]
    return getattr(out, "loss", None) if hasattr(out, "loss") else out


def problem(ops) -> dict | None:
    from kprof.rules.problems import to_dtype

    mm = ops[(ops["phase"] == "fwd") & ops["op"].str.contains(r"::(?:mm|addmm|matmul|linear)$", regex=True)]
    best = None
    for shapes, dtypes in zip(mm["input_shapes"], mm["input_dtypes"]):
        s = [tuple(x) for x in shapes if x is not None and len(x)]
        if len(s) >= 2 and len(s[1]) == 2:
            rows = 1
            for d in s[0][:-1]:
                rows *= d
            vocab = max(s[1])
            if best is None or vocab > best["vocab"]:
                best = {"n_rows": rows, "hidden": s[0][-1], "vocab": vocab, "dtype": to_dtype(dtypes[0])}
    return best


RULE = Rule(
    id="linear_cross_entropy",
    title="lm head + cross-entropy -> fused linear cross-entropy (no logits in memory)",
    kernels=(KERNEL,),
    match=match,
    replace=replace,
    profile=ProfilePattern(own_any=("log_softmax", "nll_loss", "cross_entropy_loss", "nll_loss_nd"), root_only=True,
                           evidence=("own:log_softmax", "own:nll_loss", "own:nll_loss_forward", "own:to",
                                     "own:_to_copy", "own:copy_", "own:log_softmax_backward_data",
                                     "own:nll_loss_backward", "childmod:mm", "childmod:linear")),
    problem=problem,
    outputs=loss_output,
    tensor_core=True,
    change="kprof linear_cross_entropy kernel (vocab-chunked; logits never materialised)",
)

"""RMSNorm (any spelling) -> kprof's fused rms_norm kernel.

Recognised by behaviour: a leaf module with one 1-D `weight` and an eps attribute whose forward,
on a small random input, equals `rms_norm_reference` with offset 0 (Llama, Qwen2, Mistral, T5, a
user's own: y = w * x / rms(x)) or offset 1 (Gemma: y = (1 + w) * x / rms(x)). Eager RMSNorm in
HF code is ~6 kernels forward (to fp32, pow, mean, add+rsqrt, mul, cast, mul by w), each a full
pass over (B*T, H); the fused kernel reads x once and writes y once. `torch.nn.RMSNorm` with
eps=None (the machine epsilon of the input's dtype) is matched too; the epsilon is then taken
per call from the input's dtype, as torch does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kprof.rules.engine import ProfilePattern, Rule, closest, eps_of, param_like, probe_input, reference_fn
from kprof.rules.problems import rows_cols_from_first_input

KERNEL = "rms_norm:rms_norm"

# Probe order: the common variant first. casting only changes results in low precision, so in
# fp32 the first offset that fits wins; in bf16/fp16 the probe tells llama- from gemma-casting.
_VARIANTS = ((0.0, "llama"), (1.0, "gemma"), (0.0, "gemma"), (1.0, "llama"))


def match(path: str, m: nn.Module) -> dict | None:
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or any(True for _ in m.children()):
        return None
    if getattr(m, "bias", None) is not None or isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
        return None  # affine norms with a bias are LayerNorm's rule
    eps = eps_of(m)
    ref = reference_fn(KERNEL)
    # nn.RMSNorm(eps=None) uses the machine epsilon of the input's dtype, decided per call
    by_dtype = eps is None and "eps" in vars(m) and m.eps is None
    if (eps is None and not by_dtype) or ref is None:
        return None
    device, dtype = param_like(m)
    x = probe_input((2, 3, w.shape[0]), device, dtype)
    e = torch.finfo(dtype).eps if by_dtype else eps
    cands = {(offset, casting): (lambda o=offset, c=casting: ref(x, w, e, offset=o, casting=c))
             for offset, casting in _VARIANTS}
    best = closest(lambda: m.forward(x), cands, dtype)
    if best is None:
        return None
    return {"eps": None if by_dtype else eps, "offset": best[0], "casting": best[1]}


def replace(m: nn.Module, p: dict) -> dict:
    from kprof.rules.engine import kernel_fn

    fused = kernel_fn(KERNEL)
    eps, offset, casting = p["eps"], p["offset"], p["casting"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        e = torch.finfo(x.dtype).eps if eps is None else eps
        return fused(x, m.weight, e, offset=offset, casting=casting)  # m.weight: the original Parameter

    return {"": forward}


RULE = Rule(
    id="rms_norm",
    title="RMSNorm -> fused rms_norm",
    kernels=(KERNEL,),
    match=match,
    replace=replace,
    profile=ProfilePattern(own_all=("rsqrt", "mean"), own_none=("native_layer_norm", "layer_norm"), evidence=("*",)),
    problem=rows_cols_from_first_input,
    change="kprof rms_norm kernel (one read of x, one write of y; fp32 statistics)",
)

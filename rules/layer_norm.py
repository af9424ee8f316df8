"""LayerNorm -> kprof's layer_norm kernel.

`nn.LayerNorm` over the last dim, and any leaf module with a 1-D weight, an optional 1-D bias and
an eps that behaves like `layer_norm_reference` on a probe (a user's own LayerNorm). Comes after the
RMSNorm rule: a module is offered to this rule only if it is not an RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kprof.rules.engine import (
    ProfilePattern,
    Rule,
    behaves_like,
    eps_of,
    kernel_fn,
    param_like,
    probe_input,
    reference_fn,
)
from kprof.rules.problems import rows_cols_from_first_input

KERNEL = "layer_norm:layer_norm"


def match(path: str, m: nn.Module) -> dict | None:
    w = getattr(m, "weight", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or any(True for _ in m.children()):
        return None
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) != 1:
        return None
    b = getattr(m, "bias", None)
    if b is not None and (not isinstance(b, nn.Parameter) or b.shape != w.shape):
        return None
    eps = eps_of(m)
    ref = reference_fn(KERNEL)
    if eps is None or ref is None:
        return None
    device, dtype = param_like(m)
    x = probe_input((2, 3, w.shape[0]), device, dtype)
    if behaves_like(lambda: m.forward(x), lambda: ref(x, w, b, eps), dtype):
        return {"eps": eps}
    return None


def replace(m: nn.Module, p: dict) -> dict:
    fused = kernel_fn(KERNEL)
    eps = p["eps"]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return fused(x, m.weight, getattr(m, "bias", None), eps)

    return {"": forward}


RULE = Rule(
    id="layer_norm",
    title="LayerNorm -> fused layer_norm",
    kernels=(KERNEL,),
    match=match,
    replace=replace,
    profile=ProfilePattern(own_any=("native_layer_norm", "layer_norm")),
    problem=rows_cols_from_first_input,
    change="kprof layer_norm kernel (one pass forward, fused dx/dw/db backward)",
)

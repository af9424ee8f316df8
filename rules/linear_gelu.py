"""Linear -> GELU (GPT-2's MLP: c_fc, then GELU) -> matmul without bias, then fused bias_gelu.

Eager runs the bias inside the GEMM (addmm) and GELU as its own pass over the (B*T, 4H) output,
plus a GELU backward pass. Here the Linear runs without its bias and one kernel adds the bias and
applies GELU (and computes dx and dbias in one backward pass).

Structure: a module with an affine child L (nn.Linear, or HF's Conv1D whose weight is (in, out))
with a bias, and a parameter-free child A. Behaviour: the module's forward must be unchanged when
L computes gelu(x W + b) and A is the identity, on a probe; that also proves A is applied to L's
output and nowhere else the probe reaches. The whole module is verified again on its first real
call.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules.engine import (
    ProfilePattern,
    Rule,
    behaves_like,
    closest,
    kernel_fn,
    param_like,
    probe_input,
    reference_fn,
)
from kprof.rules.problems import rows_cols_from_first_input

KERNEL = "bias_gelu:bias_gelu"


def _affine_kind(c: nn.Module) -> str | None:
    """'linear' (y = x W^T + b), 'conv1d' (HF GPT-2: y = x W + b) or None."""
    w, b = getattr(c, "weight", None), getattr(c, "bias", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 2 or not isinstance(b, nn.Parameter) or b.dim() != 1:
        return None
    if any(True for _ in c.children()):
        return None
    device, dtype = w.device, w.dtype
    if isinstance(c, nn.Linear):
        return "linear"
    if b.shape[0] == w.shape[1]:
        x = probe_input((2, w.shape[0]), device, dtype, seed=1)
        if behaves_like(lambda: c.forward(x), lambda: x @ w + b, dtype):
            return "conv1d"
    return None


def _no_bias(c: nn.Module, kind: str):
    if kind == "linear":
        return lambda x: F.linear(x, c.weight)
    return lambda x: x @ c.weight


def _in_features(c: nn.Module, kind: str) -> int:
    return c.weight.shape[1] if kind == "linear" else c.weight.shape[0]


def match(path: str, m: nn.Module) -> dict | None:
    ref = reference_fn(KERNEL)
    if ref is None:
        return None
    kids = dict(m.named_children())
    acts = [n for n, c in kids.items() if not any(True for _ in c.parameters()) and not any(True for _ in c.children())
            and _is_gelu(c, *param_like(m))]
    if not acts:
        return None
    affine = {n: k for n, c in kids.items() if (k := _affine_kind(c)) is not None}
    if not affine:
        return None
    device, dtype = param_like(m)
    for lin_name, kind in affine.items():
        lin = kids[lin_name]
        x = probe_input((2, 3, _in_features(lin, kind)), device, dtype, seed=2)
        mm = _no_bias(lin, kind)
        cands = {}
        for act_name in acts:
            for approximate in ("tanh", "none"):  # in bf16 both may pass: the closest is the module's
                def patched(lin=lin, mm=mm, act_name=act_name, approximate=approximate, x=x):
                    with _overridden(m, {lin_name: lambda t: ref(mm(t), lin.bias, approximate=approximate),
                                         act_name: lambda t: t}):
                        return m.forward(x)
                cands[(act_name, approximate)] = patched
        best = closest(lambda x=x: m.forward(x), cands, dtype)
        if best is not None:
            return {"linear": lin_name, "kind": kind, "act": best[0], "approximate": best[1]}
    return None


def _is_gelu(c: nn.Module, device, dtype) -> bool:
    """A parameter-free leaf whose forward is GELU (erf or tanh) on a probe: by what it computes,
    not by its class name (GPT-2's NewGELUActivation, nn.GELU, a user's own)."""
    x = probe_input((2, 16), device, dtype, seed=4) * 3  # spread over GELU's curved part
    return any(behaves_like(lambda: c(x), lambda a=a: F.gelu(x, approximate=a), dtype) for a in ("tanh", "none"))


class _overridden:
    """Temporarily give children instance-level forwards (used by the probe only)."""

    def __init__(self, m: nn.Module, fwds: dict):
        self.items = [(getattr(m, n), f) for n, f in fwds.items()]

    def __enter__(self):
        for c, f in self.items:
            c.forward = f

    def __exit__(self, *exc):
        for c, _ in self.items:
            del c.forward


def replace(m: nn.Module, p: dict) -> dict:
    fused = kernel_fn(KERNEL)
    lin = getattr(m, p["linear"])
    mm, approximate = _no_bias(lin, p["kind"]), p["approximate"]

    def linear_forward(x: torch.Tensor) -> torch.Tensor:
        h = mm(x)
        # Under autocast the matmul runs in bf16/fp16 and nn.Linear would add a bias cast to that
        # dtype: do the same (an fp32 bias against a bf16 h is a dtype error in the kernel).
        return fused(h, lin.bias.to(h.dtype), approximate=approximate)

    def identity(x: torch.Tensor) -> torch.Tensor:  # GELU already applied by the fused kernel
        return x

    return {p["linear"]: linear_forward, p["act"]: identity}


RULE = Rule(
    id="linear_gelu",
    title="Linear -> GELU -> matmul + fused bias_gelu",
    kernels=(KERNEL,),
    match=match,
    replace=replace,
    # GELU in an activation child: F.gelu ("gelu") or GPT-2's NewGELU spelled with tanh.
    profile=ProfilePattern(child_any=("gelu", "tanh"), own_none=("mul", "silu", "gelu"), child_linear=1,
                           evidence=("childmod:gelu", "childmod:tanh")),
    problem=rows_cols_from_first_input,  # the activation's input: the gate / pre-GELU (…, I)
    change="kprof bias_gelu kernel (bias add + GELU in one pass after a bias-free matmul)",
    confidence="medium",
)

"""Gated MLP (gate/up/down Linears with SiLU or GELU) -> fused swiglu / geglu.

Structure: a module with exactly three direct Linear children, two H -> I and one I -> H. Which of
the two H -> I is the gate, and which activation, is found by probing: the module's forward must
equal down(act(a(x)) * b(x)) for one assignment. Eager runs act and the multiply as two kernels
that each read and write a (B*T, I) tensor (plus two more in backward); the fused kernel reads gate
and up once and writes the product once.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules.engine import ProfilePattern, Rule, closest, kernel_fn, param_like, probe_input
from kprof.rules.problems import rows_cols_from_first_input

SWIGLU, GEGLU = "glu:swiglu", "glu:geglu"

_ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "gelu": F.gelu,
}


def _linears(m: nn.Module) -> dict[str, nn.Linear]:
    return {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}


def match(path: str, m: nn.Module) -> dict | None:
    lin = _linears(m)
    if len(lin) != 3:
        return None
    ups = [n for n, c in lin.items() if c.out_features > c.in_features]
    downs = [n for n, c in lin.items() if c.out_features < c.in_features]
    if len(ups) != 2 or len(downs) != 1:
        return None
    a, b = (lin[n] for n in ups)
    d = lin[downs[0]]
    if a.weight.shape != b.weight.shape or d.in_features != a.out_features or d.out_features != a.in_features:
        return None
    device, dtype = param_like(m)
    x = probe_input((2, 3, a.in_features), device, dtype)
    cands = {(gate, up, act): (lambda g=lin[gate], u=lin[up], f=f: d(f(g(x)) * u(x)))
             for gate, up in ((ups[0], ups[1]), (ups[1], ups[0])) for act, f in _ACTS.items()}
    best = closest(lambda: m.forward(x), cands, dtype)
    if best is None:
        return None
    gate, up, act = best
    return {"gate": gate, "up": up, "down": downs[0], "act": act}


def replace(m: nn.Module, p: dict) -> dict:
    gate, up, down = (getattr(m, p[k]) for k in ("gate", "up", "down"))
    # gate(x) and up(x) are this forward's own temporaries, read by nothing but the fused kernel:
    # its backward may write the grads over them (grad_in_place; 2 x 128 MiB less at the 1B
    # Llama's backward peak, kernels/glu.py).
    if p["act"] == "silu":
        fused = kernel_fn(SWIGLU)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return down(fused(gate(x), up(x), grad_in_place=True))
    else:
        fused, approximate = kernel_fn(GEGLU), ("tanh" if p["act"] == "gelu_tanh" else "none")

        def forward(x: torch.Tensor) -> torch.Tensor:
            return down(fused(gate(x), up(x), approximate=approximate, grad_in_place=True))

    return {"": forward}


RULE = Rule(
    id="gated_mlp",
    title="gated MLP act(gate) * up -> fused swiglu/geglu",
    kernels=(SWIGLU, GEGLU),
    match=match,
    replace=replace,
    # The mul sits in the MLP module itself; silu/gelu in an activation child (HF ACT2FN modules)
    # or in the module itself (F.silu in forward).
    profile=ProfilePattern(own_all=("mul",), child_any=("silu", "gelu", "tanh"), child_linear=3,
                           evidence=("own:mul", "childmod:silu", "childmod:gelu", "childmod:tanh")),
    problem=rows_cols_from_first_input,  # the activation's input: the gate / pre-GELU (…, I)
    change="kprof swiglu/geglu kernel (act and multiply in one pass, fwd and bwd)",
)

"""A complete user rule: a packed gate|up MLP (Phi-3's `gate_up_proj`) -> kprof's swiglu_packed.

Load it with `kprof suggest --rules examples/custom_rules` and `kprof apply SCRIPT --rules
examples/custom_rules --patch packed_swiglu`, or in Python:
`kprof.patch(model, rules=[RULE])`. User rules go before the built-ins (they win).

A rule is data (kprof.rules.Rule):
- `match(path, module)`: structure first (one Linear H -> 2I, one Linear I -> H), then behaviour:
  the module's own forward on a small random input must equal down(silu(gate) * up) with
  gate, up = gate_up(x).chunk(2). Return the parameters the replacement needs, or None.
- `replace(module, params)`: {child path ("" = the module itself): new forward}. Build it from
  the module's own children and Parameters (no new Parameters: optimizers and checkpoints keep
  working). kprof verifies it against the original on its first real call.
- `profile`: how the pattern shows in a profile's op table, for `kprof suggest` (ops named
  without the aten:: prefix; see kprof.rules.ProfilePattern), `evidence`: the ops it removes.
- `problem`: the kernel's cost-model arguments from the evidence ops, for the saving estimate.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.rules import ProfilePattern, Rule
from kprof.rules.engine import behaves_like, kernel_fn, param_like, probe_input
from kprof.rules.problems import first_shape

KERNEL = "glu:swiglu_packed"


def match(path: str, m: nn.Module) -> dict | None:
    lin = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}
    if len(lin) != 2:
        return None
    (a, la), (b, lb) = lin.items()
    gate_up, down = (a, b) if la.out_features > lb.out_features else (b, a)
    gu, dn = lin[gate_up], lin[down]
    if gu.out_features != 2 * dn.in_features or dn.out_features != gu.in_features:
        return None
    device, dtype = param_like(m)
    x = probe_input((2, 3, gu.in_features), device, dtype)

    def eager():
        g, u = gu(x).chunk(2, dim=-1)
        return dn(F.silu(g) * u)

    if behaves_like(lambda: m.forward(x), eager, dtype):
        return {"gate_up": gate_up, "down": down}
    return None


def replace(m: nn.Module, p: dict) -> dict:
    fused = kernel_fn(KERNEL)
    gate_up, down = getattr(m, p["gate_up"]), getattr(m, p["down"])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return down(fused(gate_up(x)))

    return {"": forward}


def problem(ops) -> dict | None:
    got = first_shape(ops[ops["op"].str.endswith("::silu")])  # silu's input: the gate half
    if got is None:
        return None
    shape, dtype = got
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return {"n_rows": rows, "n_cols": shape[-1], "dtype": dtype}


RULE = Rule(
    id="packed_swiglu",
    title="packed gate|up MLP -> fused swiglu_packed",
    kernels=(KERNEL,),
    match=match,
    replace=replace,
    profile=ProfilePattern(own_all=("silu", "mul", "chunk"), child_linear=2,
                           evidence=("own:silu", "own:mul")),
    problem=problem,
    change="kprof swiglu_packed kernel (reads gate|up once, writes the product once)",
)

"""Inline patterns in a forward, rewritten on the graph traced at the first call: inline RMSNorm
and silu(g) * u; a look-alike is declined with the structural reason."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.patching.install import patch as kprof_patch
from kprof.rules import RULES, find_matches


class Block(nn.Module):
    """RMSNorm and SwiGLU written inline, as in many hand-written training scripts."""

    def __init__(self, h=32, i=48):
        super().__init__()
        self.norm_w = nn.Parameter(torch.rand(h) + 0.5)
        self.eps = 1e-6
        self.gate = nn.Linear(h, i, bias=False)
        self.up = nn.Linear(h, i, bias=False)
        self.down = nn.Linear(i, h, bias=False)
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w
        h = self.proj(h)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class NotRMS(nn.Module):
    """rsqrt of a mean, but of x (not x^2): must not be taken for an RMSNorm."""

    def __init__(self, h=32):
        super().__init__()
        self.w = nn.Parameter(torch.rand(h) + 0.5)
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        return self.lin(x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + 1e-6) * self.w)


def test_inline_patterns_rewritten_verified_and_unpatched():
    torch.manual_seed(0)
    ref = nn.Sequential(Block(), Block())
    model = copy.deepcopy(ref)
    report = kprof_patch(model)
    # planned before the first call: the candidates, matched on their first call's graph
    assert [(r.rule, r.path, r.status) for r in report.records] == [("inline_fx", "0", "pending"),
                                                                    ("inline_fx", "1", "pending")]
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = model(x)
    assert all(r.status == "verified" for r in report.records), str(report)
    assert report.records[0].params == {"sites": ["x * rsqrt(mean(x^2) + 1e-06) * norm_w -> rms_norm",
                                                  "silu(g) * u -> swiglu"]}
    gm = model[0].forward.graph_module  # after verification: the rewritten forward's GraphModule
    assert gm.norm_w is model[0].norm_w and gm.gate is model[0].gate  # the module's own objects
    code = gm.code
    assert "rms_norm" in code and "swiglu" in code and "rsqrt" not in code and "silu(" not in code
    y.sum().backward()
    y_ref = ref(x.detach().requires_grad_())
    torch.testing.assert_close(y, y_ref, rtol=2e-5, atol=1e-5)  # fp32 row of the TOLERANCE table

    report.unpatch()
    assert "forward" not in model[0].__dict__


def test_lookalike_is_declined_with_the_structural_reason():
    model = NotRMS()
    assert [m.rule.id for m in find_matches(model, RULES)] == ["inline_fx"]  # a candidate: it calls rsqrt
    report = kprof_patch(model)
    model(torch.randn(2, 3, 32))
    assert report.records == [] and [r.path for r in report.declined] == [""]
    assert "no inline RMSNorm (rsqrt of a mean of squares" in report.declined[0].note
    assert "forward" not in model.__dict__  # nothing installed

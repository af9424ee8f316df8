"""The rope rule on functions found by behaviour: a full rotation, a partial rotary (GPT-NeoX's
form: fused), and a function that takes a narrower cos but rotates something else (kept)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

from kprof.kernels.common import assert_close
from kprof.patching.install import patch as kprof_patch


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_full(q, k, cos, sin, unsqueeze_dim=1):  # HF Llama's
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_neox(q, k, cos, sin, unsqueeze_dim=1):  # transformers' GPT-NeoX: the first R rotated
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    return (torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q_pass], -1),
            torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k_pass], -1))


def rope_last(q, k, cos, sin, unsqueeze_dim=1):  # a narrower cos rotates the LAST R: not the kernel's
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = q.shape[-1] - cos.shape[-1]
    q_pass, q_rot, k_pass, k_rot = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    return (torch.cat([q_pass, q_rot * cos + _rotate_half(q_rot) * sin], -1),
            torch.cat([k_pass, k_rot * cos + _rotate_half(k_rot) * sin], -1))


HQ, HK, D = 3, 1, 24


def _model(fn, rot_dim):
    """A one-attention model whose class lives in a fresh module holding `fn` (the rule patches
    the function in that namespace)."""
    ns = types.ModuleType(f"kprof_test_rope_{fn.__name__}_{rot_dim}")
    fn = types.FunctionType(fn.__code__, vars(ns), fn.__name__, fn.__defaults__)  # defined in ns
    fn.__module__ = ns.__name__
    vars(ns).update({fn.__name__: fn, "torch": torch, "nn": nn, "_rotate_half": _rotate_half})
    src = f"""
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, {HQ * D}), nn.Linear(16, {HK * D})

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, {HQ}, {D}).transpose(1, 2)
        k = self.k(x).view(b, s, {HK}, {D}).transpose(1, 2)
        q, k = {fn.__name__}(q, k, cos, sin)
        return (q @ k.transpose(-1, -2)).sum(-1)
"""
    exec(compile(src, ns.__name__, "exec"), vars(ns))  # noqa: S102
    vars(ns)["Attn"].__module__ = ns.__name__
    sys.modules[ns.__name__] = ns
    torch.manual_seed(0)
    return vars(ns)["Attn"]()


def _tables(b, s, r):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    ang = torch.arange(s).float()[:, None] * inv_freq
    emb = torch.cat([ang, ang], -1).expand(b, s, r)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("fn, rot_dim, partial, fused", [
    (rope_full, D, None, True),
    (rope_neox, 8, "fused", True),  # a third of D = 24
    (rope_neox, 10, "fused", True),  # R / 2 odd
    (rope_last, 8, "original", False),
])
def test_rope_rule_fuses_partial_rotary(fn, rot_dim, partial, fused):
    model = _model(fn, rot_dim)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    cos, sin = _tables(2, 5, rot_dim)
    ref = model(x, cos, sin)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    report = kprof_patch(model, rules=["rope"])
    try:
        [rec] = report.records
        assert rec.params["partial"] == partial, rec.params
        out = model(x, cos, sin)
        out.square().sum().backward()
        assert rec.status == "verified", str(report)
        calls = rec.params["calls"]
        assert (calls["fused"] > 0, calls["original"] > 0) == (fused, not fused), calls
        assert_close(out, ref)
        for p, g in zip(model.parameters(), ref_grads):
            assert_close(p.grad, g)
    finally:
        report.unpatch()
        sys.modules.pop(type(model).__module__, None)

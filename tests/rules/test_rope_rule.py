"""The rope rule on functions found by behaviour: a full rotation, a partial rotary (GPT-NeoX's
form: fused), and a function that takes a narrower cos but rotates something else (kept)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn

from kprof.kernels.common import TOLERANCE, assert_close
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


def _grad_close(grad, ref):
    """Weight grads sum over positions and heads in orders that differ between the two sides: by
    relative norm at the fp32 table's rtol, as tests/corpus does."""
    assert float((grad - ref).norm() / ref.norm()) <= TOLERANCE[torch.float32].rtol


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
            _grad_close(p.grad, g)
    finally:
        report.unpatch()
        sys.modules.pop(type(model).__module__, None)


def rope_complex(xq, xk, freqs_cis):  # torchtitan's apply_rotary_emb
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    fc = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * fc).flatten(3).type_as(xq), torch.view_as_real(xk_ * fc).flatten(3).type_as(xk)


def rope_complex_conj(xq, xk, freqs_cis):  # rotates the other way: not the kernel's form
    return rope_complex(xq, xk, freqs_cis.conj())


def _complex_model(fn, call=True):
    """As _model, in torchtitan's layout: [B, S, H, D] and a complex freqs_cis [S, D/2]."""
    ns = types.ModuleType(f"kprof_test_rope_{fn.__name__}_{call}")
    fn = types.FunctionType(fn.__code__, vars(ns), fn.__name__, fn.__defaults__)
    fn.__module__ = ns.__name__
    vars(ns).update({"rope_complex": rope_complex, "torch": torch, "nn": nn})  # rope_complex_conj calls it
    vars(ns)[fn.__name__] = fn
    rotate = f"q, k = {fn.__name__}(q, k, freqs_cis)" if call else "pass"
    src = f"""
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, {HQ * D}), nn.Linear(16, {HK * D})

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q, k = self.q(x).view(b, s, {HQ}, {D}), self.k(x).view(b, s, {HK}, {D})
        {rotate}
        return (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).sum(-1)
"""
    exec(compile(src, ns.__name__, "exec"), vars(ns))  # noqa: S102
    vars(ns)["Attn"].__module__ = ns.__name__
    sys.modules[ns.__name__] = ns
    torch.manual_seed(0)
    return vars(ns)["Attn"]()


@pytest.mark.parametrize("fn, call, found", [
    (rope_complex, True, True),
    (rope_complex_conj, True, False),
    (rope_complex, False, False),  # in the namespace, but no class of the model calls it
])
def test_rope_rule_fuses_complex_form(fn, call, found):
    model = _complex_model(fn, call)
    try:
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
        inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        freqs_cis = torch.polar(torch.ones(5, D // 2), torch.outer(torch.arange(5).float(), inv_freq))
        ref = model(x, freqs_cis)
        ref.square().sum().backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        report = kprof_patch(model, rules=["rope"])
        try:
            assert [r.params["form"] for r in report.records] == (["complex"] if found else []), str(report)
            out = model(x, freqs_cis)
            out.square().sum().backward()
            if found:
                [rec] = report.records
                assert rec.status == "verified" and rec.params["calls"] == {"fused": 2, "original": 0}, str(report)
            assert_close(out, ref)
            for p, g in zip(model.parameters(), ref_grads):
                _grad_close(p.grad, g)
        finally:
            report.unpatch()
    finally:
        sys.modules.pop(type(model).__module__, None)

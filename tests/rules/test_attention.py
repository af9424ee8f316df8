"""Attention matched on the traced graph: a mask from an argument is passed as attn_mask (not
taken for causal), and what SDPA can't reproduce is declined with the structural reason."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kprof.patching.install import patch as kprof_patch

H, NH = 16, 2


class Attn(nn.Module):
    def __init__(self, p=0.0, return_weights=False):
        super().__init__()
        # No k bias: it adds a per-row constant to the scores, so its exact gradient is 0 and the
        # two sides' rounding noise (~1e-9) differs by ~100% in relative norm (verify.py has no
        # absolute floor for an exactly-zero gradient; see the report of issue 20).
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H, bias=False), nn.Linear(H, H)
        self.drop = nn.Dropout(p)
        self.return_weights = return_weights

    def forward(self, x, pad_mask):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, NH, H // NH).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = q @ k.transpose(-2, -1) / math.sqrt(H // NH)
        s = s.masked_fill(pad_mask[:, None, None, :] == 0, float("-inf"))  # a padding mask, per batch
        w = self.drop(F.softmax(s, dim=-1))
        y = (w @ v).transpose(1, 2).reshape(B, T, H)
        return (y, w) if self.return_weights else y


def _run(model, x, mask):
    report = kprof_patch(model, rules=["attention_sdpa"])
    model(x, mask)
    return report


def test_padding_mask_argument_becomes_attn_mask_and_verifies():
    torch.manual_seed(0)
    ref = Attn()
    model = copy.deepcopy(ref)
    x, mask = torch.randn(2, 5, H), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    report = _run(model, x, mask)
    assert [(r.rule, r.status) for r in report.records] == [("attention_sdpa", "verified")], str(report)
    assert report.records[0].params == {"sites": ["softmax(q·k + mask) @ v -> sdpa(attn_mask)"]}
    torch.testing.assert_close(model(x, mask), ref(x, mask), rtol=2e-5, atol=1e-5)


def test_returned_weights_and_live_dropout_are_declined_with_the_reason():
    x, mask = torch.randn(2, 5, H), torch.ones(2, 5)
    report = _run(Attn(return_weights=True), x, mask)
    assert report.records == [] and "used by more than @ v" in report.declined[0].note
    report = _run(Attn(p=0.1).train(), x, mask)
    assert report.records == [] and "dropout p=0.1 in training" in report.declined[0].note

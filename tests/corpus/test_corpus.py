"""The corpus of model styles (tests/corpus/models.py): on each, `kprof.patch` installs exactly
the rule classes the style's source holds (EXPECTED, less the GAPS kprof can't install yet), every
installed patch verifies on its first call, and the patched model's loss, its gradients and one
optimizer step match the original's.

Tiny shapes (hidden 32, one layer, B*T = 16): every kprof kernel runs in the Triton interpreter.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from models import EXPECTED, GAPS, STYLES, UNFUSED, B, T, V

from kprof.kernels.common import TOLERANCE
from kprof.patching.install import patch as kprof_patch

pytest.importorskip("transformers")

TOL = TOLERANCE[torch.float32]


def _params(styles):
    return [pytest.param(n, marks=pytest.mark.slow) if s.slow else n for n, s in styles.items()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / (b.norm() or 1.0))


def _patched(name):
    style = STYLES[name]
    torch.manual_seed(0)
    ref = style.build().train()
    model = copy.deepcopy(ref)
    opt_ref = style.optimizer(ref) if style.optimizer else None
    opt = style.optimizer(model) if style.optimizer else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernels' "no Triton backend" fallbacks on CPU
        report = kprof_patch(model, optimizer=opt)
    return style, ref, model, opt_ref, opt, report


@pytest.mark.parametrize("name", _params(STYLES))
def test_style_installs_its_patterns_and_trains_like_eager(name):
    style, ref, model, opt_ref, opt, report = _patched(name)
    x = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_ref = style.loss(ref, x)
        loss_ref.backward()
        loss = style.loss(model, x)
        loss.backward()

    installed = {r.rule for r in report.records if r.status == "verified"}
    assert installed == EXPECTED[name] - GAPS.get(name, set()), str(report)
    assert not report.failed and not report.pending, str(report)

    for r in report.records:  # RoPE's record counts which calls ran the kernel
        if r.rule == "rope":
            fused = r.params["calls"]["fused"]
            assert (fused == 0) == (r.rule in UNFUSED.get(name, set())), (name, r.params)
    assert _rel(loss.detach(), loss_ref.detach()) <= TOL.rtol
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert p.grad is not None, n
            assert _rel(p.grad, q.grad) <= TOL.rtol, n  # gradient sums reorder: by relative norm
    if opt is not None:
        # The same gradients on both sides: Adam's first update is ~lr * sign(g), so fp32 rounding
        # in a near-zero gradient (a bias) would flip it; the step itself is what's compared here.
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        opt_ref.step()
        opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=TOL.atol, rtol=TOL.rtol, msg=n)
    report.unpatch()


@pytest.mark.parametrize("name", sorted(GAPS))
def test_gaps_are_still_gaps(name):
    """A gap that starts installing must move into EXPECTED (keeps the list honest)."""
    style, _, model, _, _, report = _patched(name)
    x = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        style.loss(model, x).backward()
    installed = {r.rule for r in report.records if r.status == "verified"}
    assert not (GAPS[name] & installed), str(report)

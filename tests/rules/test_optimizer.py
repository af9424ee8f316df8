"""Optimizers switched to their fused step in place: state and hyperparameters kept, one step
proven on copies, the same trajectory as the unpatched optimizer, and unpatch restores the flags."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from kprof.patching.install import patch as kprof_patch
from kprof.rules import optimizer as optim_rule


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=False),
])
def test_fused_step_installed_mid_training_tracks_the_original(make):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    b = copy.deepcopy(a)
    oa, ob = make(a.parameters()), make(b.parameters())
    x = torch.randn(4, 8)
    report = None
    for i in range(3):
        if i == 1:  # after a step: the moments exist and must be kept
            state_ids = {id(t) for st in ob.state.values() for t in st.values() if torch.is_tensor(t)}
            report = kprof_patch(b, rules=[], optimizer=ob)
            assert ob.param_groups[0]["fused"] and not ob.param_groups[0]["foreach"]
            kept = {id(t) for st in ob.state.values() for k, t in st.items() if torch.is_tensor(t) and k != "step"}
            assert kept <= state_ids
        for m, o in ((a, oa), (b, ob)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert [(r.rule, r.status) for r in report.records] == [("fused_optimizer", "verified")]
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-5, atol=1e-5)
    report.unpatch()
    assert not ob.param_groups[0]["fused"]


def test_subclass_and_already_fused_are_declined_with_the_reason():
    class MyAdam(torch.optim.Adam):
        pass

    p = [nn.Parameter(torch.randn(3))]
    assert "not torch.optim.Adam/AdamW/SGD" in optim_rule.plan(MyAdam(p)).reason
    assert optim_rule.plan(torch.optim.Adam(p, fused=True)).reason == "already fused"
    report = kprof_patch(nn.Linear(2, 2), rules=[], optimizer=MyAdam(p))
    assert report.records == [] and report.declined[0].rule == "fused_optimizer"

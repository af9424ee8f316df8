"""The cuda_graphs patch (rules/cuda_graphs.py) and its plan (rules/diagnoses/launch_bound.py):
declined with the reason when something blocks a graph, verified at its first call before any
capture, a wrong compile caught and reverted, its own group in the ablation. No timed assertions."""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn

import kprof.rules.cuda_graphs as cg
from kprof.errors import KprofError
from kprof.patching import ablation as ab
from kprof.patching import apply as ap
from kprof.patching.install import patch as kprof_patch
from kprof.plan.suggest import parse_ids
from kprof.rules.diagnoses import launch_bound


def _mlp(depth: int = 3, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def _records(report) -> list[tuple[str, str]]:
    return [(r.rule, r.status) for r in report.records]


# ---------------------------------------------------------------------------------------------
# Live conditions


def test_live_model_declined_with_the_reason():
    m = _mlp()
    report = kprof_patch(m, rules=["cuda_graphs"])
    assert report.records == [] and "not a CUDA device" in report.declined[0].note
    assert "forward" not in m.__dict__  # nothing installed
    assert "already compiled" in cg.plan(torch.compile(m, backend="eager"), cuda_only=False)
    drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    assert "dropout active in training mode at 1 (p=0.1)" in cg.plan(drop, cuda_only=False)
    assert cg.plan(drop.eval(), cuda_only=False) == ""  # no random numbers drawn in eval
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    assert "several devices (cpu, meta)" in cg.plan(mixed, cuda_only=False)
    assert "no parameters" in cg.plan(nn.ReLU(), cuda_only=False)


def test_kprof_patch_without_rules_installs_what_apply_kept(monkeypatch, tmp_path):
    import sys

    from kprof import store

    script = tmp_path / "train.py"
    script.write_text("")
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setattr(store, "latest_kept", lambda s: ("20261202-mlp", ["cuda_graphs"]))
    report = kprof_patch(_mlp())
    assert "kprof apply kept (20261202-mlp): cuda_graphs" in report.notes[0]
    # resolved and tried on this model: a CPU model is declined, with the reason
    assert [(r.rule, r.status) for r in report.declined] == [("cuda_graphs", "declined")]


def test_root_forward_taken_by_an_earlier_rule_is_said():
    # what apply reports when cuda_graphs found the root forward already replaced (find_matches)
    why = ap.why_not_installed({"id": "cuda_graphs"}, [])
    assert "root forward, which was replaced first (by a rule earlier in precedence" in why


def test_rule_is_named_by_id_only():
    from kprof.patching.install import resolve_rules

    assert "cuda_graphs" not in [r.id for r in resolve_rules("all")]  # never by "all": it compiles the model
    assert [r.id for r in resolve_rules(["cuda_graphs"])] == ["cuda_graphs"]


# ---------------------------------------------------------------------------------------------
# The plan: what in the run blocks a graph


H200 = {"device": "NVIDIA H200", "mem_bw_gbs": 4161.0, "latency_us": 14.1, "kind": "measured"}


def _summary(**kw) -> dict:
    s = {"device": {"type": "cuda", "name": "NVIDIA H200"}, "ceilings": H200, "steps_recorded": 2, "syncs": [],
         "module_classes": {"": "Net"}, "script": "/nonexistent/train.py", "step_time_ms": {"median": 1.0},
         "idle_by_step": [{"step": s, "window (us)": 1000.0, "busy (us)": 200.0, "idle (us)": 800.0} for s in (0, 1)],
         "input_wait_by_step": [], "root_input_shapes": [{"shapes": [[32, 256]], "calls": 7}]}
    return s | kw


def _ops(extra_fwd: tuple[str, ...] = ()) -> pd.DataFrame:
    """Two steps of 100 short elementwise kernels (launch-bound), plus `extra_fwd` forward ops."""
    rows = []
    for step in (0, 1):
        rows += [{"step": step, "phase": "fwd", "op": "aten::add", "n_kernels": 1, "device_time (us)": 3.0,
                  "kernel": "elementwise_kernel"} for _ in range(100)]
        rows += [{"step": step, "phase": "fwd", "op": op, "n_kernels": 1, "device_time (us)": 3.0,
                  "kernel": "k"} for op in extra_fwd]
    return pd.DataFrame(rows)


def _graphs(ops, summary):
    (lb,) = launch_bound.find(ops, summary)
    (g,) = launch_bound.find_graphs(ops, summary)
    return lb, g


def test_static_launch_bound_step_is_installable():
    lb, g = _graphs(_ops(), _summary())
    assert g.applyable and g.how.startswith("kprof apply --patch cuda_graphs")
    assert "kprof apply --patch cuda_graphs installs it" in lb.how  # the advice names the patch id
    assert g.saving_ms == lb.saving_ms
    plan = {"run": "r", "diagnoses": [{"id": "cuda_graphs", "applyable": True, "how": g.how}]}
    assert parse_ids("all", plan) == ["cuda_graphs"]


def test_cpu_run_is_blocked():
    # launch_bound itself finds nothing on a CPU run; the blocker list still says why
    assert launch_bound.graph_blockers(_ops(), _summary(device={"type": "cpu"})) == [
        "not a CUDA run: CUDA graphs record GPU kernels"]
    assert launch_bound.find_graphs(_ops(), _summary(device={"type": "cpu"})) == []
    plan = {"run": "r", "diagnoses": [{"id": "unfused_optimizer", "applyable": True}]}
    with pytest.raises(KprofError, match=r"cuda_graphs not in the plan of run r \(cuda_graphs is planned beside a "
                                         r"launch_bound finding, a GPU run"):
        parse_ids("cuda_graphs", plan)


def test_dynamic_shapes_are_blocked():
    shapes = [{"shapes": [[32, n]], "calls": 1} for n in (100, 117, 96)]
    lb, g = _graphs(_ops(), _summary(root_input_shapes=shapes))
    assert not g.applyable and "input shapes vary over the recorded steps (3 different" in g.how
    assert "kprof apply can't install it (cuda_graphs)" in lb.how
    plan = {"run": "r", "diagnoses": [{"id": "cuda_graphs", "applyable": False, "how": g.how}]}
    with pytest.raises(KprofError, match="cuda_graphs can't be applied automatically: not installable: the model's"):
        parse_ids("cuda_graphs", plan)
    (g,) = launch_bound.find_graphs(_ops(), {k: v for k, v in _summary().items() if k != "root_input_shapes"})
    assert not g.applyable and "profile again" in g.how  # a run from before shapes were recorded


def test_syncs_inside_the_forward_are_blocked(tmp_path):
    _, g = _graphs(_ops(("aten::_local_scalar_dense",)), _summary())
    assert not g.applyable and "host syncs inside the model's forward (local_scalar_dense)" in g.how
    script = tmp_path / "train.py"
    script.write_text("class Net:\n    def forward(self, x):\n        if x.sum().item() > 0:\n            pass\n"
                      "        return x\n\nloss.item()\n")
    inside = {"kind": "Tensor.item", "file": str(script), "line": 3, "function": "forward", "count": 2,
              "code": "if x.sum().item() > 0:"}
    _, g = _graphs(_ops(), _summary(syncs=[inside]))
    assert not g.applyable and "train.py:3 Tensor.item" in g.how
    # the training loop's own .item() (outside any forward) does not block the model's graph
    outside = inside | {"line": 7, "function": "<module>", "code": "loss.item()"}
    _, g = _graphs(_ops(), _summary(syncs=[outside]))
    assert g.applyable


def test_random_ops_and_compiled_steps_are_blocked():
    _, g = _graphs(_ops(("aten::native_dropout",)), _summary())
    assert not g.applyable and "random ops in the forward (native_dropout)" in g.how
    ops = _ops()
    ops["kernel"] = "triton_poi_fused_add_0"
    _, g = _graphs(ops, _summary())
    assert not g.applyable and "already compiled" in g.how


# ---------------------------------------------------------------------------------------------
# Install and verification on a CPU model (reduce-overhead compiles there, without graphs)


def _train(m, steps: int = 3) -> list[float]:
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # Inductor compiles the MLP's forward and backward on the CPU (~20 s on 2 cores)
def test_reduce_overhead_install_verified_on_cpu():
    m, ref = _mlp(), _mlp()
    graphs0 = cg.graphs_compiled()
    report = kprof_patch(m, rules=[cg.cuda_graphs_rule(cuda_only=False)])
    assert _records(report) == [("cuda_graphs", "pending")]
    got, want = _train(m), _train(ref)
    assert _records(report) == [("cuda_graphs", "verified")]
    v = report.records[0].verification
    assert v.ok and v.method == "table" and v.dtype == torch.float32
    names = [c.what for c in v.checks]
    assert "output 0" in names and "grad 0.weight" in names and "grad 4.bias" in names  # every parameter's grad
    assert "cuda_graphs: every input on cpu" in names  # the rule's own check ran
    assert cg.graphs_compiled() > graphs0  # the forward ran compiled, counted as the patch's own
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    report.unpatch()
    assert "forward" not in m.__dict__


def test_planted_wrong_compile_is_caught_and_reverted(monkeypatch):
    def wrong(m):  # a "compiled" forward 1% off
        return lambda *a, **kw: type(m).forward(m, *a, **kw) * 1.01

    monkeypatch.setattr(cg, "compiled_forward", wrong)
    m = _mlp()
    x = torch.randn(4, 16)
    want = m(x)
    report = kprof_patch(m, rules=[cg.cuda_graphs_rule(cuda_only=False)])
    with pytest.warns(UserWarning, match="cuda_graphs at <model> failed verification.*reverted"):
        got = m(x)
    assert _records(report) == [("cuda_graphs", "reverted")]
    assert "FAILED" in report.records[0].verification.summary()
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the original forward answered
    assert "forward" not in m.__dict__
    kprof_patch(m2 := _mlp(), rules=[cg.cuda_graphs_rule(cuda_only=False)], strict=True)
    with pytest.raises(KprofError, match="cuda_graphs at <model> failed verification"):
        m2(x)


def test_scalar_outputs_are_cloned_out_of_the_graph(monkeypatch):
    out = torch.tensor(2.0)
    monkeypatch.setattr(cg, "compiled_forward", lambda m: lambda *a, **kw: (out, out.reshape(1)))
    loss, vec = cg.graphed(nn.Linear(1, 1))()
    assert loss is not out and loss.data_ptr() != out.data_ptr() and vec.data_ptr() == out.data_ptr()


def test_ablation_times_it_as_its_own_group(monkeypatch):
    # Dynamo alone (no Inductor): what the ablation sees is a model compiled by the patch itself,
    # which must not read as "the script compiles its model"
    monkeypatch.setattr(cg, "compiled_forward",
                        lambda m: torch.compile(type(m).forward.__get__(m), backend="eager", dynamic=False))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 16))
    ids = ["layer_norm", "cuda_graphs"]
    abl = ap._Ablation(ids, strict=True, rules_dir=None, budget=None, seed=0,
                    rules=["layer_norm", cg.cuda_graphs_rule(cuda_only=False)])
    abl.on_root(m)
    x = torch.randn(4, 16)
    for _ in range(2):  # the first call verifies every patch
        m(x).sum().backward()
    assert {r.rule: r.status for r in abl._records()} == {"layer_norm": "verified", "cuda_graphs": "verified"}
    assert abl.on_step(0) is False and abl.declined is None  # the patch's own compile: still ablated
    assert sorted(abl.groups) == [("cuda_graphs",), ("layer_norm",)]  # wraps the root: not nested with layer_norm
    assert {c.name for c in abl.plan} == {ab.ALL_ON, ab.ALL_OFF, "without layer_norm", "without cuda_graphs"}
    abl.enable_all()
    for rep in abl.reports:
        rep.unpatch()


# ---------------------------------------------------------------------------------------------
# On a GPU: the MLP, verified, then replayed as CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mlp_graphs_verified_and_replayed(monkeypatch):
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import CUDAGraphNode

    replays = []
    run_graph = CUDAGraphNode.run_graph
    monkeypatch.setattr(CUDAGraphNode, "run_graph", lambda self: (replays.append(1), run_graph(self))[1])
    torch.manual_seed(0)
    m = nn.Sequential(*[x for _ in range(12) for x in (nn.Linear(256, 256), nn.ReLU())]).cuda()
    ref = copy.deepcopy(m)
    skips = counters["inductor"]["cudagraph_skips"]
    report = kprof_patch(m, rules=["cuda_graphs"])
    x = torch.randn(32, 256, device="cuda")
    losses = {}
    for name, model in (("graphs", m), ("eager", ref)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(6):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert _records(report) == [("cuda_graphs", "verified")] and report.records[0].verification.ok
    assert counters["inductor"]["cudagraph_skips"] == skips  # nothing kept it out of a graph
    assert replays  # forward and backward replayed from recorded graphs
    torch.testing.assert_close(torch.tensor(losses["graphs"]), torch.tensor(losses["eager"]), rtol=1e-4, atol=1e-6)
    report.unpatch()


def test_runner_records_the_models_input_shapes(tmp_path):
    from kprof.analyze.profile import profile_script

    script = tmp_path / "varying.py"
    script.write_text(
        "import torch\ntorch.manual_seed(0)\nm = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())\n"
        "loss_fn = torch.nn.MSELoss()  # an outermost module too: its inputs are not the model's\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\nfor i in range(20):\n"
        "    x = torch.randn(4 + i % 3, 8)\n    loss_fn(m(x), torch.zeros(4 + i % 3, 8)).backward()\n"
        "    opt.step()\n    opt.zero_grad()\n")
    run = profile_script(str(script), [], warmup=1, steps=2, out_root=tmp_path / "runs")
    shapes = sorted(r["shapes"][0][0] for r in run.summary["root_input_shapes"])
    assert shapes == [4, 5, 6]
    assert any("input shapes vary" in b for b in launch_bound.graph_blockers(run.ops, run.summary))


@pytest.mark.slow  # three runs of the script, Inductor compiling in two (~1-2 min on 2 cores)
def test_apply_end_to_end_on_cpu(tmp_path, monkeypatch):
    """`kprof apply --patch cuda_graphs` through the ablation, the after run and the loss watch,
    with the rule allowed on a CPU (reduce-overhead compiles there; nothing is timed here)."""
    import json

    import kprof.rules
    from kprof import store
    from kprof.analyze.profile import profile_script
    from kprof.patching.apply import apply
    from kprof.plan.suggest import plan_for

    monkeypatch.setattr(kprof.rules, "STEP_RULES", [cg.cuda_graphs_rule(cuda_only=False)])
    script = tmp_path / "mlp.py"
    script.write_text(
        "import torch\ntorch.manual_seed(0)\n"
        "m = torch.nn.Sequential(*[x for _ in range(3) for x in (torch.nn.Linear(16, 16), torch.nn.ReLU())])\n"
        "opt = torch.optim.Adam(m.parameters(), lr=1e-3)\nx, y = torch.randn(4, 16), torch.randn(4, 16)\n"
        "for _ in range(80):\n    torch.nn.functional.mse_loss(m(x), y).backward()\n    opt.step()\n"
        "    opt.zero_grad()\n")
    root = tmp_path / "runs"
    before = profile_script(str(script), [], warmup=1, steps=2, out_root=root)
    plan = plan_for(before)  # a CPU run: no launch_bound finding, so the row is added as a GPU run's would be
    plan["diagnoses"].append({"id": "cuda_graphs", "applyable": True, "where": "whole step", "paths": [],
                              "saving ms/step": None, "how": "kprof apply --patch cuda_graphs"})
    (Path(before.path) / store.PLAN).write_text(json.dumps(plan))
    res = apply(str(script), patch="cuda_graphs", out_root=root, steps=14)
    assert res.declined is None  # the patch's own compile is not the script compiling its model
    assert res.ablation is not None and res.ablation.groups == [("cuda_graphs",)]
    recs = res.to_dict()["records"]["ablation"]
    assert [(r["rule"], r["status"]) for r in recs] == [("cuda_graphs", "verified")]
    (row,) = res.suggestions.to_dict("records")
    assert row["verified"] and row["verdict"] in ("kept", "dropped", "undecided")
    if res.kept:  # whatever the CPU timing decided: the kept set ran verified and its losses were watched
        assert [(r.rule, r.status) for rep in res.reports for r in rep.records] == [("cuda_graphs", "verified")]
        assert res.watch is not None and not res.watch["diverged"]

"""kprof apply's ablation on a script that compiles its model (issues #18/#19): the patch
configurations switched inside the compiled model, each compiled once and re-used from Dynamo's
cache with the right outputs; the recompile limits raised for the run and restored; a frame that
hits the limit anyway declines the ablation with the reason; `kprof apply` end to end on scripts
that compile their model.

The fast tests compile with a recording backend or "eager" (Dynamo without Inductor, no C++
toolchain); Inductor runs in the slow one. No timed assertions: the planted end-to-end case's
decisions come from 25 ms sleeps, far above a step's own time."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from test_ablation import _COMPILED, _SCRIPT, _app, _rules
from typer.testing import CliRunner

from kprof.analyze.profile import profile_script
from kprof.patching import ablation as ab
from kprof.patching import apply as ap

# Planted rules whose patches compute the same values through other ops, so the graph Dynamo
# compiled says which configuration it holds: tanh(x) = 2 sigmoid(2x) - 1, sigmoid(x) = 1 / (1 + e^-x).
_SWAP = """
import torch
from kprof.rules import ProfilePattern, Rule

def match(path, m):
    return {{}} if type(m).__name__ == {cls!r} else None

def replace(m, p):
    def forward(x):
        return {body}
    return {{"": forward}}

RULE = Rule(id={id!r}, title="planted", kernels=(), match=match, replace=replace,
            profile=ProfilePattern(own_any=({op!r},)))
"""


def _swap_rules(tmp_path: Path) -> str:
    d = tmp_path / "swap_rules"
    d.mkdir()
    for rid, cls, op, body in (("tanh_as_sigmoid", "Tanh", "tanh", "2 * torch.sigmoid(2 * x) - 1"),
                               ("sigmoid_as_exp", "Sigmoid", "sigmoid", "1 / (1 + torch.exp(-x))")):
        (d / f"{rid}.py").write_text(textwrap.dedent(_SWAP.format(id=rid, cls=cls, op=op, body=body)))
    return str(d)


class _Recorder:
    """A Dynamo backend that keeps each graph's ops and which graph ran at each call."""

    def __init__(self):
        self.graphs: list[set[str]] = []
        self.ran: list[int] = []

    def __call__(self, gm, example_inputs):
        gid = len(self.graphs)
        self.graphs.append({getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                            if n.op == "call_function"})

        def run(*args):
            self.ran.append(gid)
            return gm.forward(*args)

        return run


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid())


IDS = ["tanh_as_sigmoid", "sigmoid_as_exp"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test as in a fresh process: Dynamo's cache entries on code objects every compiled
    # module shares (torch.compile's wrapper) count toward the recompile limit across tests.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _expected_ops(conf: ab.Config) -> tuple[bool, bool]:
    """(tanh in the graph, exp in the graph) for a configuration: each of the four is distinct."""
    return "tanh_as_sigmoid" in conf.off, "sigmoid_as_exp" not in conf.off


def test_configurations_compile_once_each_with_the_right_outputs(tmp_path):
    rec = _Recorder()
    model, ref = _mlp(), _mlp()
    budget = ab.steps_needed(len(IDS), ab.MIN_BLOCKS, ab.WARM_BLOCKS_COMPILED)
    abl = ap._Ablation(IDS, strict=True, rules_dir=_swap_rules(tmp_path), budget=budget, seed=0)
    compiled = torch.compile(model, backend=rec)
    abl.on_root(model)
    x = torch.randn(4, 16)
    limits = ap._recompile_limits()
    try:
        for _ in range(2):  # the first call verifies every patch (eagerly), the second compiles them
            compiled(x).sum().backward()
        assert {r.rule: r.status for r in abl._records()} == dict.fromkeys(IDS, "verified")
        k = len(ab.configs(IDS))
        graphs_by_conf: dict[str, int] = {}
        i = 0
        while not abl.on_step(i):
            if i == 0:
                assert abl.compiled and abl.warm == ab.WARM_BLOCKS_COMPILED and abl.declined is None
                assert ap._recompile_limits() == {n: v + k for n, v in limits.items()}
            conf, n_graphs, n_ran = abl.plan[i], len(rec.graphs), len(rec.ran)
            model.zero_grad()
            out = compiled(x)
            out.sum().backward()
            graphs_by_conf[conf.name] = graphs_by_conf.get(conf.name, 0) + len(rec.graphs) - n_graphs
            (gid,) = rec.ran[n_ran:]  # one graph: the whole model, not split at the patches' gates
            ops = rec.graphs[gid]
            assert "linear" in ops and ("tanh" in ops, "exp" in ops) == _expected_ops(conf), (conf.name, ops)
            ref.zero_grad()
            want = ref(x)
            want.sum().backward()
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
            i += 1
        assert i == len(abl.plan) == budget
        # each configuration compiled once, in the warm blocks (all on too: the first timed step
        # drops the code compiled around the patches' first-call gates)
        assert graphs_by_conf == dict.fromkeys(graphs_by_conf, 1) and len(graphs_by_conf) == k
        assert abl.graphs == k
        assert abl.compiled_steps() and max(abl.compiled_steps()) < ab.WARM_BLOCKS_COMPILED * k
    finally:
        abl.restore()
        for rep in abl.reports:
            rep.unpatch()
    assert ap._recompile_limits() == limits


def test_recompile_limit_hit_declines_with_the_reason(tmp_path):
    from torch._dynamo import config

    name = next(iter(ap._recompile_limits()))
    model = _mlp()
    # dynamic=False: every new batch size is a new graph, the script's own recompiles
    compiled = torch.compile(model, backend="eager", dynamic=False)
    abl = ap._Ablation(IDS[:1], strict=True, rules_dir=_swap_rules(tmp_path), budget=None, seed=0)
    abl.on_root(model)
    with config.patch(**{name: 1}):
        try:
            for _ in range(2):
                compiled(torch.randn(4, 16)).sum().backward()
            i = 0
            while not abl.on_step(i):
                compiled(torch.randn(5 + i, 16)).sum().backward()
                i += 1
            assert i < len(abl.plan)  # stopped at the first step after the hit
            assert "Dynamo hit its recompile limit" in abl.declined and f"{name} 3" in abl.declined
            assert "ran uncompiled" in abl.declined
        finally:
            abl.restore()
            for rep in abl.reports:
                rep.unpatch()
        assert getattr(config, name) == 1


def test_compile_of_uncompiled_script_keeps_one_warm_block(tmp_path):
    model = _mlp()
    abl = ap._Ablation(IDS, strict=True, rules_dir=_swap_rules(tmp_path), budget=None, seed=0)
    abl.on_root(model)
    limits = ap._recompile_limits()
    try:
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
        assert abl.on_step(0) is False
        assert not abl.compiled and abl.warm == ab.WARM_BLOCKS and abl.compiled_steps() == []
        assert ap._recompile_limits() == limits  # nothing raised for an eager script
        assert len(abl.plan) == ab.steps_needed(len(IDS)) <= abl.max_steps
    finally:
        abl.restore()
        for rep in abl.reports:
            rep.unpatch()


# ---------------------------------------------------------------------------------------------
# `kprof apply` end to end on a script that compiles its model

def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# test_ablation's planted script (25 ms sleeps), its model compiled by Dynamo
_COMPILED_PLANTED = _edit(_SCRIPT, 'model = nn.Sequential(*[parts[p]() for p in sys.argv[1].split(",")])',
                          'model = torch.compile(nn.Sequential(*[parts[p]() for p in sys.argv[1].split(",")]), '
                          'backend="eager")')


def test_apply_on_a_compiled_script_keeps_what_beats_compile(tmp_path):
    script = tmp_path / "compiled.py"
    script.write_text(_COMPILED_PLANTED)
    root = tmp_path / "runs"
    rules = _rules(tmp_path)
    limits = ap._recompile_limits()
    profile_script(str(script), ["sleepy,plain", "100"], warmup=1, steps=2, out_root=root)
    # 2 groups -> 4 configurations; 56 steps = 2 warm blocks (compiled) + 12 counted blocks
    res = CliRunner().invoke(_app(), ["apply", str(script), "--patch", "fast,slow", "--rules", str(rules), "--out",
                                      str(root), "--steps", "56", "--json", "--", "sleepy,plain", "100"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["ablation_declined"] is None and doc["ablation"]["blocks"] == 12
    assert doc["ablation"]["warm_blocks"] == ab.WARM_BLOCKS_COMPILED and doc["ablation"]["uncounted_steps"] == []
    by = {p["id"]: p for p in doc["patches"]}
    assert by["fast"]["verdict"] == "kept" and by["slow"]["verdict"] == "dropped", by
    c = doc["compiled"]
    assert c["active"] == ["fast"] == doc["kept"]
    (aside,) = c["stepped_aside"]
    assert aside["id"] == "slow" and aside["verdict"] == "dropped" and aside["measured_saving_ms"] < 0
    assert c["warm_blocks"] == ab.WARM_BLOCKS_COMPILED and c["warm_steps"] == 8 and c["extra_warm_steps"] == 4
    assert c["graphs"] >= 1 and c["warm_s"] > 0 and c["compile_s"] is not None
    assert all(i < 8 for i in c["compiled_steps"]) and c["uncounted_steps"] == []
    assert {k: v["was"] for k, v in c["recompile_limit"].items()} == limits
    assert all(v["during"] == v["was"] + 4 for v in c["recompile_limit"].values())
    assert ap._recompile_limits() == limits  # restored
    assert any(n.startswith("the script compiles its model") for n in doc["notes"])
    assert "timed under the script's own torch.compile: slow stepped aside" in doc["recommendation"]
    # the after run: the script compiled again, the kept patch verified inside it
    assert [(r["rule"], r["status"]) for r in doc["records"]["after"]] == [("fast", "verified")]
    assert doc["after_ms"] > 0 and doc["losses_agree"] is True
    # the lines that keep it say how to recompile the model whole once the patches are verified
    assert doc["write_lines"].endswith(ap.COMPILED_LINES) and "rules=['fast']" in doc["write_lines"]


# test_ablation's compiled script, compiled by Inductor when given --compile
_COMPILED_INDUCTOR = _edit(_edit(_COMPILED, "import torch\n", "import sys, torch\n"),
                           'model = torch.compile(model, backend="eager")  # Dynamo without a C++ toolchain',
                           'if "--compile" in sys.argv:\n    model = torch.compile(model, backend="inductor")')


@pytest.mark.slow  # Inductor compiles every configuration's forward and backward on the CPU (~15 s on 2 cores)
def test_apply_under_inductor_end_to_end(tmp_path):
    from rich.console import Console

    from kprof.cli import patch_cmds as cli_patch

    script = tmp_path / "compiled.py"
    script.write_text(_COMPILED_INDUCTOR)
    root = tmp_path / "runs"
    limits = ap._recompile_limits()
    # Planned from the uncompiled script: Inductor fuses the CPU LayerNorm into its own kernels,
    # so the compiled run's plan has no layer_norm to patch on this tiny model.
    plan_run = profile_script(str(script), [], warmup=1, steps=2, out_root=root)
    res = ap.apply(str(script), ["--compile"], patch="layer_norm", run=plan_run.name, out_root=root, steps=16)
    assert res.declined is None and res.ablation is not None
    c = res.compiled
    assert c["warm_blocks"] == ab.WARM_BLOCKS_COMPILED and c["warm_steps"] == 4 and c["graphs"] >= 1
    assert all(i < 4 for i in c["compiled_steps"]) and c["uncounted_steps"] == []
    assert c["active"] == res.kept
    assert [r["id"] for r in c["stepped_aside"]] == [i for i in ["layer_norm"] if i not in res.kept]
    assert ap._recompile_limits() == limits
    assert json.loads((Path(res.after.path) / "apply.json").read_text())["compiled"]["graphs"] == c["graphs"]
    # the after run compiled the script again, with the kept set alone (verified inside it)
    assert all(r.status == "verified" for rep in res.reports for r in rep.records)
    out = Console(width=100, record=True)
    cli_patch.render_apply(res, out)
    text = out.export_text()
    assert "active under compile" in text and "the script compiles its model" in text


def test_render_says_active_and_stepped_aside_under_compile():
    from types import SimpleNamespace

    import pandas as pd
    from rich.console import Console

    from kprof.cli import patch_cmds as cli_patch

    frame = pd.DataFrame([{"id": "rms_norm", "kept": True, "verdict": "kept", "measured_saving_ms": 1.5,
                           "measured_interval_ms": [1.0, 2.0], "n": 20, "reason": "faster"},
                          {"id": "gated_mlp", "kept": False, "verdict": "dropped", "measured_saving_ms": -0.4,
                           "measured_interval_ms": [-0.6, -0.2], "n": 20, "reason": "slower"}])
    under = ap._under_compile(frame)
    assert under["active"] == ["rms_norm"]
    assert under["stepped_aside"] == [{"id": "gated_mlp", "verdict": "dropped", "measured_saving_ms": -0.4,
                                       "measured_interval_ms": [-0.6, -0.2], "n": 20, "reason": "slower"}]
    res = SimpleNamespace(ablation=None, declined=None, compiled=under, suggestions=frame.iloc[:0],
                          not_installed=[], batch_headroom=None)
    out = Console(width=100, record=True)
    cli_patch._render_ablation(res, out)
    text = out.export_text()
    assert "active under compile: rms_norm" in text
    assert "stepped aside under compile: gated_mlp (dropped, saving -0.4 ms/step)" in text

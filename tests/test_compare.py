"""`kprof apply SCRIPT --compare`: eager vs kprof patches vs torch.compile vs both, each variant in
its own subprocess and saved as a run (kprof/patching/compare.py). CPU: a tiny seeded script, Inductor's
C++ backend and the Triton interpreter; the Llama end-to-end comparison runs on the GPU."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from kprof import store
from kprof.analyze.profile import profile_script
from kprof.cli import patch_cmds as cli_patch
from kprof.errors import KprofError
from kprof.patching.compare import (
    VARIANTS,
    CompareResult,
    VariantResult,
    compare,
    load_compare,
    parse_variants,
    verdict,
)

ROOT = Path(__file__).resolve().parents[1]

# Seeded, so every variant sees the same weights and data; a LayerNorm for kprof's layer_norm
# patch. 3 warm-up + 2 timed + 1 profiler warm-up + 2 recorded = 8 steps of the 12.
_TINY = """
import sys, torch
torch.manual_seed(0)
{prelude}
model = torch.nn.Sequential({first}torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 32)
for step in range(12):
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

# A custom op with no fake (meta) implementation, in the model: eager runs it, torch.compile can't
# trace it.
_NO_FAKE = """
@torch.library.custom_op("kprof_test::double", mutates_args=())
def double(t: torch.Tensor) -> torch.Tensor:
    return t * 2

class Double(torch.nn.Module):
    def forward(self, t):
        return double(t)
"""

# A wrong LayerNorm replacement (weight + 0.1): fails verification, an error under --strict.
_BAD_RULE = """
import torch.nn as nn, torch.nn.functional as F
from kprof.rules import ProfilePattern, Rule

def match(path, m):
    return {} if isinstance(m, nn.LayerNorm) else None

def replace(m, p):
    return {"": lambda x: F.layer_norm(x, m.normalized_shape, m.weight + 0.1, m.bias, m.eps)}

RULE = Rule(id="bad_ln", title="a wrong LayerNorm", kernels=(), match=match, replace=replace,
            profile=ProfilePattern(own_any=("native_layer_norm",)))
"""

SMALL = dict(warmup=3, steps=2)


def _script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def _tiny(tmp_path: Path, name="tiny.py", no_fake=False) -> Path:
    return _script(tmp_path, name, _TINY.format(prelude=_NO_FAKE if no_fake else "",
                                                first="Double(), " if no_fake else ""))


def _app():
    app = typer.Typer()
    cli_patch.register(app)
    return app


def _run_main(argv):
    """kprof.cli.main's contract (KprofError -> message, exit code) around the test app."""
    try:
        _app()(args=argv, prog_name="kprof", standalone_mode=False)
    except KprofError as e:
        raise SystemExit(e.exit_code) from e


# Four subprocess variants, two of them compiled by Inductor (~30 s on 2 cores): slow. The fast set's
# comparison runs through the CLI in test_a_script_that_fails_and_a_script_with_nothing_to_patch.
@pytest.mark.slow
def test_four_variants_on_a_tiny_script(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_patch, "console", Console(width=250, record=True))
    root = tmp_path / "runs"
    script = _tiny(tmp_path)
    res = CliRunner().invoke(_app(), ["apply", str(script), "--compare", "--out", str(root), "--warmup", "3",
                                      "--steps", "2"])
    assert res.exit_code == 0, res.output + repr(res.exception)

    runs = store.list_runs(root)
    assert sorted(p.name.rsplit("-", 1)[1] for p in runs) == ["compile", "eager", "kprof", "kprof_compile"]
    doc = load_compare(runs[0])
    for p in runs:  # the same comparison beside every variant's run, and each a complete run
        assert json.loads((p / "compare.json").read_text()) == doc
        assert store.load_run(p).summary["steps_recorded"] == 2
    rows = {r["variant"]: r for r in doc["variants"]}
    assert list(rows) == list(VARIANTS)
    assert doc["runs"] == {v: Path(r["run"]).name for v, r in rows.items()}
    for v, r in rows.items():
        assert r["status"] == "ok", (v, r["error"])
        st = r["step_time_ms"]
        assert st["n"] == 2 and 0 < st["p10"] <= st["median"] <= st["p90"] and math.isfinite(st["median"])
        assert r["peak_memory_bytes"] > 10 * 2**20  # process RSS on the CPU: torch alone is more
        assert r["warmup_s"] > 0 and r["warmup_steps"] == 3
        # Every variant's loss agrees with eager's at the first step it ran wholly: rounding only.
        assert r["loss_agree"] is True and r["loss_rel_diff"] < 1e-4, (v, r)
    assert rows["eager"]["speedup"] == 1.0
    assert rows["compile"]["speedup"] > 0 and rows["kprof"]["speedup"] > 0
    # Steps before the variant's code ran: step 0 as written; kprof patches at step 1 (verified on
    # it); compile compiles at step 1, kprof+compile after its patches verified.
    assert [rows[v]["loss_step"] for v in VARIANTS] == [0, 1, 1, 2]

    # The kprof rows show the plan's patch, verified; the plan came from the eager run (no profile
    # of this script before the comparison).
    assert doc["plan_run"] == doc["runs"]["eager"] and doc["patch_ids"] == ["layer_norm"]
    for v in ("kprof", "kprof+compile"):
        assert [(p["rule"], p["path"], p["status"]) for p in rows[v]["patches"]] == [("layer_norm", "1", "verified")]
    for v in ("eager", "compile"):
        assert rows[v]["patches"] == [] and not (v == "eager" and rows[v]["compile"])
    # Compiled, and kprof's custom op traced without a graph break.
    for v in ("compile", "kprof+compile"):
        c = rows[v]["compile"]
        assert c["mode"] == "default" and c["roots"] == ["Sequential"] and c["graphs"] >= 1
        assert c["graph_breaks"] == 0, c["break_reasons"]
    assert rows["compile"]["warmup_s"] > rows["eager"]["warmup_s"]  # compilation lands in the warm-up

    assert doc["cpu"] is True and doc["choice"] in VARIANTS and doc["verdict"].startswith(("use ", "stay with eager"))
    text = cli_patch.console.export_text()
    for word in ("kprof+compile", "1/1 verified", "0 breaks", "verdict:", "CPU run",
                 "Triton interpreter", "compare.json"):
        assert word in text, word

    # A later comparison plans from the eager run of the last one, not from a patched/compiled run.
    from kprof.patching.compare import _plan_run

    assert _plan_run(str(script), None, root).name == doc["runs"]["eager"]

    # `kprof report` on any variant's run shows the whole comparison again, from compare.json.
    from kprof import cli

    monkeypatch.setattr(cli, "console", Console(width=250, record=True))
    res = CliRunner().invoke(cli.app, ["report", str(runs[-1]), "--out", str(root)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    shown = cli.console.export_text()
    assert "kprof apply --compare" in shown and doc["verdict"].split(" ")[0] in shown
    assert all(f"run  {v}" in shown for v in VARIANTS)


@pytest.mark.slow
def test_a_failing_variant_is_reported_and_the_others_still_run(tmp_path):
    """kprof fails under --strict (its patch fails verification), compile fails (a custom op torch.compile
    can't trace); eager completes, and compile still runs after kprof failed."""
    root = tmp_path / "runs"
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "bad_ln.py").write_text(_BAD_RULE)
    script = _tiny(tmp_path, no_fake=True)
    res = compare(str(script), variants="eager,kprof,compile", patch="bad_ln", strict=True, rules_dir=str(rules),
                  out_root=root, **SMALL)
    eager, kp, comp = res.variants
    assert [r.variant for r in res.variants] == ["eager", "kprof", "compile"]
    assert eager.status == "ok" and eager.ok and eager.run is not None
    assert kp.status == "failed" and kp.run is None and "bad_ln at 2 failed verification" in kp.error
    assert comp.status == "failed" and comp.run is None and "no fake impl" in comp.error
    assert res.choice == "eager" and "no other variant completed" in res.verdict
    # The partial comparison is saved beside the run that exists, failures included.
    doc = load_compare(eager.run)
    assert [(r["variant"], r["status"]) for r in doc["variants"]] == [("eager", "ok"), ("kprof", "failed"),
                                                                      ("compile", "failed")]
    assert len(store.list_runs(root)) == 1


def test_bad_input(tmp_path):
    root = tmp_path / "runs"
    script = _tiny(tmp_path)
    with pytest.raises(KprofError, match=r"unknown variant 'eagre' in --variants; choose from eager, kprof, "
                                         r"compile, kprof\+compile"):
        compare(str(script), variants="eagre,compile", out_root=root)
    with pytest.raises(KprofError, match="'kprof\\+compile'"):
        parse_variants("compile+kprof")
    with pytest.raises(KprofError, match="needs at least one"):
        parse_variants(" , ")
    assert parse_variants("kprof+compile, eager") == ["eager", "kprof+compile"]  # the table's order
    with pytest.raises(KprofError, match="unknown --compile-mode 'fast'"):
        compare(str(script), compile_mode="fast", out_root=root)
    with pytest.raises(KprofError, match="no such script"):
        compare(str(tmp_path / "missing.py"), out_root=root)
    # Only kprof variants and no profile to plan them from: impossible, before running anything.
    with pytest.raises(KprofError, match=r"--variants kprof: no profile of .*tiny.py .*run `kprof profile"):
        compare(str(script), variants="kprof", out_root=root)
    assert store.list_runs(root) == []

    # The CLI: a clear message and a non-zero exit
    with pytest.raises(SystemExit) as e:
        _run_main(["apply", str(script), "--compare", "--variants", "eager,fast", "--out", str(root)])
    assert e.value.code == 2 and "unknown variant 'fast'" in str(e.value.__cause__)
    with pytest.raises(SystemExit) as e:
        _run_main(["apply", str(script), "--variants", "eager", "--out", str(root)])
    assert e.value.code == 2 and "only goes with --compare" in str(e.value.__cause__)
    with pytest.raises(SystemExit) as e:
        _run_main(["apply", str(script), "--compare", "--write", "-", "--out", str(root)])
    assert e.value.code == 2 and "--write" in str(e.value.__cause__)


def test_a_script_that_fails_and_a_script_with_nothing_to_patch(tmp_path):
    root = tmp_path / "runs"
    broken = _script(tmp_path, "broken.py", "import torch\nraise RuntimeError('no data here')\n")
    with pytest.raises(KprofError, match=r"failed in the eager variant .* fix the script first") as e:
        compare(str(broken), out_root=root, **SMALL)
    assert "no data here" in e.value.detail and e.value.exit_code == 1  # the script's traceback, shown above
    assert store.list_runs(root) == []

    # Nothing kprof can patch (no LayerNorm): the kprof variants are skipped with the reason, not run.
    plain = _script(tmp_path, "plain.py", _TINY.format(prelude="", first="").replace(
        "torch.nn.LayerNorm(64), ", ""))
    out = CliRunner().invoke(_app(), ["apply", str(plain), "--compare", "--variants", "eager,kprof", "--json",
                                      "--warmup", "3", "--steps", "2", "--out", str(root)])
    assert out.exit_code == 0, out.output + repr(out.exception)
    doc = json.loads(out.stdout)  # --json: stdout is the document alone (progress goes to stderr)
    eager, kp = doc["variants"]
    assert eager["status"] == "ok" and eager["step_time_ms"]["median"] > 0
    assert kp["status"] == "skipped" and "nothing to patch" in kp["error"] and "would be eager" in kp["error"]
    assert doc["choice"] == "eager" and doc["plan_run"] == doc["runs"]["eager"] and list(doc["runs"]) == ["eager"]
    assert [p.name.endswith("-eager") for p in store.list_runs(root)] == [True]
    assert doc["saved"] == [str(store.list_runs(root)[0] / "compare.json")]
    # Asking for the kprof variant alone with a plan that has nothing to apply: impossible.
    profile_script(str(plain), [], warmup=1, steps=2, out_root=root)
    with pytest.raises(KprofError, match="--variants kprof: nothing to patch"):
        compare(str(plain), variants="kprof", out_root=root)
    # Explicit ids the plan lacks are an error too (not a skip); the plan has only the optimizer.
    with pytest.raises(KprofError, match="layer_norm not in the plan .* its suggestions are: unfused_optimizer"):
        compare(str(plain), variants="eager,kprof", patch="layer_norm", out_root=root)


def _row(v, med, p10, p90, agree=True, warm=1.0):
    return VariantResult(v, "ok", run=f"/x/{v}", step_time_ms={"median": med, "p10": p10, "p90": p90,
                                                               "spread": p90 - p10, "n": 5},
                         loss_agree=agree, warmup_s=warm)


def test_verdict_rules():
    def res(*rows):
        return CompareResult("t.py", [], list(rows), "default", 3, 5, device={"type": "cuda"})

    # compile beats eager beyond the noise; kprof+compile is faster still but within compile's range
    choice, line = verdict(res(_row("eager", 100, 98, 102), _row("kprof", 90, 88, 92),
                               _row("compile", 70, 68, 72, warm=21.0), _row("kprof+compile", 69, 67, 71)))
    assert choice == "compile" and "1.43x" in line and "kprof+compile is 1 ms/step faster still, but within the noise" in line
    assert "20 s more warm-up, repaid after ~667 steps" in line and "CPU" not in line
    # the fastest disagrees on the loss: excluded, the next one wins
    choice, line = verdict(res(_row("eager", 100, 98, 102), _row("kprof", 80, 79, 81),
                               _row("compile", 60, 59, 61, agree=False)))
    assert choice == "kprof" and "excluded, loss differs from eager's beyond tolerance: compile" in line
    # faster, but the ranges overlap: stay with eager
    choice, line = verdict(res(_row("eager", 100, 90, 130), _row("compile", 95, 85, 105)))
    assert choice == "eager" and "within the noise" in line
    # nothing faster
    choice, line = verdict(res(_row("eager", 100, 99, 101), _row("kprof", 300, 290, 310)))
    assert choice == "eager" and "no variant is faster" in line
    # no eager baseline
    choice, line = verdict(res(VariantResult("eager", "failed", error="boom"), _row("compile", 60, 59, 61)))
    assert choice is None and "no eager baseline" in line


@pytest.mark.gpu
def test_compare_llama_tiny_on_gpu(tmp_path):
    """On the H200: the four variants of the Llama example, real Triton kernels and Inductor."""
    script = ROOT / "examples" / "llama_train.py"
    args = ["--preset", "tiny", "--device", "cuda"]
    root = tmp_path / "runs"
    res = compare(str(script), args, out_root=root, warmup=3, steps=5)
    rows = {r.variant: r for r in res.variants}
    assert list(rows) == list(VARIANTS) and not res.cpu
    for v, r in rows.items():
        assert r.status == "ok", (v, r.error)
        assert r.peak_memory_bytes > 0 and "max_memory_allocated" in r.peak_memory_kind
        assert r.loss_agree is True, (v, r.first_loss, r.loss_rel_diff)
    for v in ("kprof", "kprof+compile"):
        rules = {p["rule"] for p in rows[v].patches}
        assert rules == {"rms_norm", "gated_mlp", "rope", "linear_cross_entropy"}
        assert all(p["status"] == "verified" for p in rows[v].patches), rows[v].patches
    for v in ("compile", "kprof+compile"):
        assert rows[v].compile["graph_breaks"] == 0, rows[v].compile["break_reasons"]
    assert res.choice in VARIANTS and len(store.list_runs(root)) == 4


def test_variant_timeout_scales_with_the_longest_run_seen():
    from kprof.patching.compare import VARIANT_TIMEOUT_MIN_S, VariantResult, variant_timeout

    assert variant_timeout([], {}) == VARIANT_TIMEOUT_MIN_S
    assert variant_timeout([], {"wall_time_s": 400.0}) == 2000.0
    done = [VariantResult("eager", "ok", wall_s=100.0), VariantResult("compile", "ok", wall_s=500.0)]
    assert variant_timeout(done, {"wall_time_s": 60.0}) == 2500.0

"""Snapshots of what `kprof report`, `runs`, `suggest` and `apply` print at 80 and 200 columns.

The runs are built by kprof's real analysis (kprof.analyze.profile.analyse and build_summary)
from the checked-in tiny Llama CPU trace (tests/data/llama_cpu.json.gz) with fixed step times,
so every number is reproducible; `apply` has its expensive part (re-running the script) patched
out with a fixed result. Each output is compared with tests/cli/snapshots/<name>-<width>.txt
(run in the store's parent folder, so no temporary path shows; the version is masked). On top
of that, no line may be wider than the terminal and no "…" may appear (rich's sign of a cut
cell). Then `--json` of every command: one JSON document on stdout, nothing else.

After an intended change of the output:  KPROF_UPDATE_SNAPSHOTS=1 pytest tests/cli
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.cells import cell_len
from rich.console import Console
from typer.testing import CliRunner

from kprof import cli, store
from kprof.cli import patch_cmds

REPO = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
WIDTHS = (80, 200)
UPDATE = os.environ.get("KPROF_UPDATE_SNAPSHOTS") == "1"

RUN = "20250101-000000-train_llama"
FAILED = "20250102-000000-train_llama"
BROKEN = "20250103-000000-broken"


def _raw(**kw):
    from kprof.capture.runner import RawRun

    fields = dict(
        script="train_llama.py", argv=["--preset", "tiny"], status="stopped", error=None, exit_code=0,
        device={"type": "cpu", "name": "Test CPU", "cpu_count": 2, "capability": None, "sm_count": None,
                "total_memory": None},
        step_definition="optimizer.step (AdamW)", warmup=3, steps=2, steps_recorded=2,
        # the trace's step windows are 164 and 664 ms (profiled); the unprofiled steps near their mean
        step_times_ms=[380.0, 400.0, 430.0], profiled_step_times_ms=[164.4, 663.8], peak_memory_bytes=600 * 2**20,
        trace_path=str(REPO / "tests" / "data" / "llama_cpu.json.gz"),
        # code with brackets: data, never rich markup
        syncs=[{"kind": "Tensor.item", "file": "train_llama.py", "line": 42, "function": "main", "count": 2,
                "steps": [0, 1], "code": 'print(f"step {i} loss {losses[-1].item():.4f}")'}],
        losses=[6.25, 6.1], tokens_per_step=16, module_classes={}, wall_time_s=3.0,
        message="kprof stopped the script after 2 recorded steps", peak_memory_label="process peak RSS")
    return RawRun(**(fields | kw))


def analysed_run(cache_dir: Path) -> tuple[dict, pd.DataFrame]:
    """The fixture run's summary and op table, by kprof's real analysis (also used by
    test_html_report.py)."""
    from kprof.analyze.profile import analyse, build_summary

    with pytest.MonkeyPatch.context() as mp:
        # No calibration cache of this machine: the CPU default ceilings, the same everywhere.
        mp.setenv("KPROF_CACHE_DIR", str(cache_dir))
        raw = _raw()
        ops, analysed = analyse(raw)
        return build_summary(raw, analysed), ops


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("snap") / "runs"
    summary, ops = analysed_run(root.parent / "cache")
    store.save_run(summary, ops, None, root=root, name=RUN)
    failed = summary | {"status": "error", "exit_code": 3,
                        "error": "Traceback (most recent call last):\n  ...\nValueError: boom"}
    store.save_run(failed, ops, None, root=root, name=FAILED)
    (root / BROKEN).mkdir()
    return root


def _invoke(monkeypatch, root: Path, width: int, args: list[str]) -> str:
    """`kprof ARGS --out runs` in-process in the store's parent folder (paths print the same in
    every temporary folder), with COLUMNS=width and consoles made as at the start of a process."""
    monkeypatch.chdir(root.parent)
    args = [*args, "--out", root.name]
    monkeypatch.setenv("COLUMNS", str(width))
    out = Console()  # rich reads COLUMNS when the console is made
    for mod in (cli, patch_cmds):
        monkeypatch.setattr(mod, "console", out)
        monkeypatch.setattr(mod, "err_console", Console(stderr=True))
    res = CliRunner().invoke(cli.app, args, env={"COLUMNS": str(width)})
    assert res.exit_code == 0, res.output + repr(res.exception)
    from kprof import __version__

    return res.stdout.replace(__version__, "<version>")


def check(name: str, width: int, text: str) -> None:
    lines = text.splitlines()
    wide = [ln for ln in lines if cell_len(ln) > width]
    assert not wide, f"{len(wide)} lines over {width} columns, e.g.\n{wide[0]}"
    assert "…" not in text, [ln for ln in lines if "…" in ln]
    # Trailing blanks are rich's padding to the table width: not part of what is compared.
    text = "\n".join(ln.rstrip() for ln in lines) + "\n"
    path = SNAPSHOTS / f"{name}-{width}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no snapshot {path}; create it with KPROF_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), (f"{name} at {width} columns differs from {path}; if the change is "
                                      "intended, update with KPROF_UPDATE_SNAPSHOTS=1")


@pytest.mark.parametrize("width", WIDTHS)
def test_report(root, monkeypatch, width):
    text = _invoke(monkeypatch, root, width, ["report", RUN])
    for word in ("Top 15 ops", "model.layers.0", "ms/step", "Host syncs", "losses[-1].item()"):
        assert word in text, word
    check("report", width, text)


@pytest.mark.parametrize("width", WIDTHS)
def test_runs(root, monkeypatch, width):
    text = _invoke(monkeypatch, root, width, ["runs"])
    assert all(name in text for name in (RUN, FAILED, BROKEN))  # whole run names, never cut
    check("runs", width, text)


@pytest.mark.parametrize("width", WIDTHS)
def test_suggest(root, monkeypatch, width):
    text = _invoke(monkeypatch, root, width, ["suggest", RUN])
    # One ranking: the unfused optimizer (a diagnosis) saves more than any kernel of this tiny
    # model and comes first; the host sync, unknown saving on a CPU run, comes last.
    ids = re.findall(r"^(?:│\s*)?(\d+)\s+(?:│\s*)?([a-z_]+)\b", text, flags=re.M)
    order = [i for _, i in ids]
    assert order[0] == "unfused_optimizer" and order[-1] == "host_sync", order
    assert [int(n) for n, _ in ids] == list(range(1, len(ids) + 1))
    check("suggest", width, text)


def _apply_result(root: Path):
    from kprof.patching.apply import ApplyResult

    before, after = store.load_run(RUN, root), store.load_run(RUN, root)

    def rec(rule, path, status, summary, source):
        return SimpleNamespace(rule=rule, path=path, status=status, source=source,
                               verification=SimpleNamespace(summary=lambda: summary))

    reports = [SimpleNamespace(records=[
        rec("rms_norm", "model.layers.0.input_layernorm", "verified",
            "max abs err 2.4e-07 (rtol 1.3e-06) on [1, 8, 64] float32", "train_llama.py:12"),
        rec("rope", "model.layers.0.self_attn", "reverted",
            "max abs err 3.1e-02 over tolerance on [1, 4, 8, 16] float32", "train_llama.py:40"),
    ])]
    steps = pd.DataFrame({"metric": ["step time (ms, median)", "peak memory (GiB)", "tokens/s"],
                          "before": [21.0, 0.59, 761.9], "after": [19.5, 0.58, 820.5],
                          "change %": [-7.1, -1.7, 7.7]})
    nan = float("nan")
    sugg = pd.DataFrame({
        "id": ["rms_norm", "rope"], "where": ["model.layers.*.input_layernorm x 2", "model.layers.*.self_attn x 2"],
        "verified": [True, False], "modules": [2, 2], "verified modules": [2, 0], "kept": [True, False],
        "predicted_saving_ms": [0.73, 0.53], "measured_saving_ms": [1.2, nan], "measured_interval_ms": [None, None],
        "n": [8, 0], "spread_ms": [0.31, nan], "memory_saving_bytes": [nan, nan], "group": [["rms_norm"], ["rope"]],
        "verdict": ["kept", "not installed"], "reason": ["faster by 1.2 ms/step (n=8, spread ±0.31 ms)",
                                                         "failed verification"]})
    losses = pd.DataFrame({"step": [0, 1], "before": [6.25, 6.1], "after": [6.25, 6.1000004],
                           "rel diff": [0.0, 6.6e-8]})
    return ApplyResult(before, after, ["rms_norm", "rope"], reports, steps, sugg, losses, True, 1e-5,
                       "import kprof\nkprof.patch(model, rules=['rms_norm'])\n",
                       ["rope (2 modules): reverted: the probe's output differs beyond the tolerance"],
                       kept=["rms_norm"], not_installed=[{"id": "rope", "why": "failed verification on 2 modules"}],
                       recommendation="keep rms_norm (1.2 ms/step faster); rope failed verification")


@pytest.mark.parametrize("width", WIDTHS)
def test_apply(root, monkeypatch, width):
    res = _apply_result(root)
    monkeypatch.setattr("kprof.patching.apply.apply", lambda *a, **kw: res)
    text = _invoke(monkeypatch, root, width, ["apply", "train_llama.py"])
    assert "first losses" in text and "reverted" in text
    check("apply", width, text)


COMPARE = {
    "script": "train_llama.py", "argv": [], "compile_mode": "default", "warmup": 3, "steps": 2,
    "device": {"type": "cpu", "name": "Test CPU"}, "plan_run": RUN, "patch_ids": ["rms_norm"],
    "verdict": "use kprof+compile: 1.31x vs eager, losses agree", "choice": "kprof+compile",
    "notes": ["CPU run: kernels run in the Triton interpreter; times say nothing about a GPU"],
    "variants": [
        {"variant": "eager", "status": "ok", "run": "<runs>/20250104-000000-train_llama-eager",
         "step_time_ms": {"median": 21.0, "p10": 20.1, "p90": 23.4}, "speedup": 1.0,
         "peak_memory_bytes": 600 * 2**20, "peak_memory_kind": "process peak RSS", "warmup_s": 0.41,
         "loss_step": 0, "first_loss": 6.25},
        {"variant": "kprof", "status": "ok", "run": "<runs>/20250104-000001-train_llama-kprof",
         "step_time_ms": {"median": 19.5, "p10": 19.0, "p90": 20.2}, "speedup": 1.077,
         "peak_memory_bytes": 598 * 2**20, "warmup_s": 0.52, "loss_step": 1, "first_loss": 6.1000004,
         "loss_rel_diff": 6.6e-8, "loss_agree": True,
         "patches": [{"rule": "rms_norm", "path": "model.layers.0.input_layernorm", "status": "verified"},
                     {"rule": "rms_norm", "path": "model.layers.1.input_layernorm", "status": "verified"}]},
        {"variant": "compile", "status": "failed", "error": "torch._dynamo.exc.Unsupported: planted\nline 2"},
        {"variant": "kprof+compile", "status": "ok", "run": "<runs>/20250104-000002-train_llama-kprof_compile",
         "step_time_ms": {"median": 16.0, "p10": 15.2, "p90": 17.9}, "speedup": 1.3125,
         "peak_memory_bytes": 2**30 + 2**28, "warmup_s": 12.75, "loss_step": 2, "first_loss": 5.9,
         "loss_rel_diff": 1.2e-6, "loss_agree": True,
         "patches": [{"rule": "rms_norm", "path": "model.layers.0.input_layernorm", "status": "verified"}],
         "compile": {"mode": "default", "graphs": 1, "graph_breaks": 0, "break_reasons": []}},
    ],
}


@pytest.mark.parametrize("width", WIDTHS)
def test_apply_compare(root, monkeypatch, width):
    from kprof.patching.compare import CompareResult

    monkeypatch.setattr("kprof.patching.compare.compare", lambda *a, **kw: CompareResult.from_dict(COMPARE))
    text = _invoke(monkeypatch, root, width, ["apply", "train_llama.py", "--compare"])
    for word in ("kprof+compile", "1.31x", "verdict:", "compile failed"):
        assert word in text, word
    check("apply-compare", width, text)


@pytest.mark.parametrize("command", ["", "profile", "runs", "report", "calibrate", "suggest", "apply"])
def test_help_fits_80_columns(monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(cli.app, [*command.split(), "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) > 5 and max(cell_len(ln) for ln in lines) <= 80


# ---------------------------------------------------------------------------------------------
# --json: one JSON document on stdout and nothing else, the same runs and results as above.


def _json(monkeypatch, args: list[str]) -> dict:
    res = CliRunner().invoke(cli.app, [*args, "--json"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return json.loads(res.stdout)  # fails on anything printed beside the document


def test_json_report_runs_suggest(root, monkeypatch):
    doc = _json(monkeypatch, ["report", RUN, "--out", str(root)])
    assert doc["run"] == RUN and doc["summary"]["steps_recorded"] == 2 and doc["compare"] is None
    doc = _json(monkeypatch, ["runs", "--out", str(root)])
    assert [(r["run"], r["status"]) for r in doc["runs"]] == [(RUN, "stopped"), (FAILED, "error"),
                                                              (BROKEN, "unreadable")]
    assert doc["runs"][0]["step_time_ms"] == 400.0 and "is missing" in doc["runs"][2]["error"]
    doc = _json(monkeypatch, ["suggest", RUN, "--out", str(root)])
    # separate lists as before (apply reads "suggestions"), one ranking across both
    ranks = {(r["id"], r["rank"]) for r in doc["suggestions"] + doc["diagnoses"]}
    assert sorted(n for _, n in ranks) == list(range(1, len(ranks) + 1))
    assert ("unfused_optimizer", 1) in ranks and {s["id"] for s in doc["suggestions"]} >= {"rms_norm", "rope"}
    assert [s["rank"] for s in doc["suggestions"]] == sorted(s["rank"] for s in doc["suggestions"])
    assert json.loads((root / RUN / "plan.json").read_text())["suggestions"] == doc["suggestions"]


def test_json_profile_keeps_the_scripts_output_off_stdout(root, monkeypatch, tmp_path):
    def fake_profile_script(script, argv, **kw):
        print("step    0  loss 6.25")  # the script's own print, while it runs
        return store.load_run(RUN, root)

    monkeypatch.setattr("kprof.analyze.profile.profile_script", fake_profile_script)
    script = tmp_path / "train.py"
    script.write_text("")
    res = CliRunner().invoke(cli.app, ["profile", str(script), "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout)["run"] == RUN and "loss 6.25" in res.stderr


def test_json_calibrate(monkeypatch, tmp_path):
    from kprof.analyze import ceilings

    monkeypatch.setenv("KPROF_CACHE_DIR", str(tmp_path))
    fake = ceilings.for_device({"type": "cpu", "name": "Test CPU"})
    monkeypatch.setattr(ceilings, "calibrate", lambda dev, quick=False: fake)
    doc = _json(monkeypatch, ["calibrate", "--quick"])
    assert doc["ceilings"]["mem_bw_gbs"] == fake.mem_bw_gbs and doc["cache"].startswith(str(tmp_path))


def test_json_apply_and_compare(root, monkeypatch):
    from kprof.patching.compare import CompareResult

    res = _apply_result(root)
    monkeypatch.setattr("kprof.patching.apply.apply", lambda *a, **kw: res)
    doc = _json(monkeypatch, ["apply", "train_llama.py", "--out", str(root)])
    assert doc["kept"] == ["rms_norm"] and doc["write_lines"] == res.write_lines
    monkeypatch.setattr("kprof.patching.compare.compare", lambda *a, **kw: CompareResult.from_dict(COMPARE))
    doc = _json(monkeypatch, ["apply", "train_llama.py", "--compare", "--out", str(root)])
    assert doc["choice"] == "kprof+compile" and [v["variant"] for v in doc["variants"]][-1] == "kprof+compile"

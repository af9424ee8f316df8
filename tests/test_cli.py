"""The CLI: argument handling and rendering with the pipeline patched out, then `kprof profile`
end to end on the bundled GPT example and on small planted scripts (bad input)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

import kprof
from kprof import cli, store
from kprof.store import Run

REPO = Path(__file__).resolve().parent.parent
GPT = REPO / "examples" / "gpt_train.py"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # Tables wrap at 80 columns when stdout is not a terminal; widen so assertions see whole cells.
    monkeypatch.setattr(cli, "console", Console(width=250, force_terminal=False, color_system=None))
    monkeypatch.setattr(cli, "err_console", Console(width=250, stderr=True, color_system=None))


def kprof_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `kprof ARGS` in-process through main(), the real entry point; returns (code, out, err)."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(map(str, args)))
    out, err = capsys.readouterr()
    return e.value.code or 0, out, err


# A summary shaped like kprof.analyze.profile.build_summary's, with made-up numbers for rendering tests.
SUMMARY = {
    "script": "train.py", "argv": ["--lr", "1"], "status": "stopped", "status_note": "stopped after 5",
    "error": None, "exit_code": 0,
    "device": {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0", "sm_count": 132,
               "total_memory": 150 * 2**30},
    "ceilings": {"device": "NVIDIA H200", "mem_bw_gbs": 4800.0, "peak_tflops": {"bf16": 989.0, "fp32": 67.0},
                 "latency_us": 4.0, "source": "datasheet: NVIDIA H200 datasheet", "kind": "datasheet", "notes": []},
    "step_definition": "optimizer.step (AdamW)", "warmup": 3, "steps": 5, "steps_recorded": 5,
    "step_times_ms": [10.0] * 5, "profiled_step_times_ms": [12.0] * 5,
    "step_time_ms": {"median": 10.0, "spread": 0.25, "spread_definition": "p10-p90", "n": 5},
    "profiled_step_time_ms": {"median": 12.0, "spread": 0.3, "n": 5},
    "profiler_overhead_pct": 20.0, "tokens_per_step": 8192, "tokens_per_s": 819200.0,
    "peak_memory_bytes": 3 * 2**30, "peak_memory_kind": "torch.cuda.max_memory_allocated",
    "busy_pct": 91.5, "coverage_pct": 98.2,
    "class_breakdown": [{"class": "compute-bound", "ms/step": 6.0, "% of step": 60.0},
                        {"class": "idle", "ms/step": 0.85, "% of step": 8.5}],
    "top_ops": [
        {"module": "model.layers.0.mlp.down_proj", "op": "aten::mm", "shapes": "[8192, 8192] x [8192, 2048]",
         "dtype": "bfloat16", "ms/step": 1.234, "% of step": 12.3, "TFLOP/s": 456.7, "GB/s": 98.0,
         "intensity (FLOP/B)": 1600.0, "% of roofline": 46.2, "class": "compute-bound"},
        {"module": "model.layers.0.input_layernorm", "op": "aten::pow", "shapes": "[4, 2048, 2048]",
         "dtype": "bfloat16", "ms/step": 0.05, "% of step": 0.5, "TFLOP/s": 0.3, "GB/s": 3100.0,
         "intensity (FLOP/B)": 0.125, "% of roofline": 65.0, "class": "memory-bound"},
        {"module": "model.layers.0.mlp.down_proj", "op": "aten::mm", "shapes": "[2048, 8192] x [8192, 8192]",
         "dtype": "bfloat16", "ms/step": 0.04, "% of step": 0.4, "TFLOP/s": 400.0, "GB/s": 90.0,
         "intensity (FLOP/B)": 1600.0, "% of roofline": 40.0, "class": "compute-bound"},
    ],
    "syncs": [{"kind": "Tensor.item", "file": "train.py", "line": 42, "code": "print(loss.item())",
               "function": "main", "count": 2, "steps": [1, 3]}],
}


def test_version_and_help(capsys):
    code, out, _ = kprof_cli(capsys, "--version")
    assert (code, out.strip()) == (0, f"kprof {kprof.__version__}")
    code, out, _ = kprof_cli(capsys, "-h")
    assert code == 0 and all(c in out for c in ("profile", "runs", "report", "calibrate"))
    code, out, _ = kprof_cli(capsys, "profile", "--help")
    assert code == 0 and "--run-to-end" in out and "--warmup" in out


def test_profile_passes_arguments_and_renders(capsys, monkeypatch, tmp_path):
    calls = []

    def fake_profile_script(script, argv, **kw):
        calls.append((script, argv, kw))
        path = store.save_run(SUMMARY, pd.DataFrame({"op": ["aten::mm"]}), None, root=kw["out_root"])
        return Run(path=path, summary=store.load_summary(path))

    monkeypatch.setattr("kprof.analyze.profile.profile_script", fake_profile_script)
    script = tmp_path / "train.py"
    script.write_text("")
    code, out, _ = kprof_cli(capsys, "profile", script, "--warmup", "1", "--steps", "2", "--step", "forward",
                             "--out", tmp_path / "runs", "--", "--lr", "1", "--steps", "9")
    assert code == 0
    (s, argv, kw), = calls
    assert s == str(script) and argv == ["--lr", "1", "--steps", "9"]  # everything after -- goes to the script
    assert {k: kw[k] for k in ("warmup", "steps", "run_to_end", "step_mode", "out_root")} == dict(
        warmup=1, steps=2, run_to_end=False, step_mode="forward", out_root=tmp_path / "runs")

    # header
    assert "NVIDIA H200  (sm_90, 132 SMs, 150.00 GiB)" in out and "datasheet: NVIDIA H200 datasheet" in out
    assert "4,800 GB/s, fp32 67 TFLOP/s, bf16 989 TFLOP/s, latency 4 us" in out
    assert "optimizer.step (AdamW)" in out
    assert re.search(r"10\.0 ms median ± 0\.25", out) and "p10-p90" in out
    assert "GPU busy 91.5%" in out and "3.00 GiB peak" in out and "+20% vs unprofiled" in out
    assert "98.2% of op time has a known FLOP/byte cost" in out
    assert "CPU run" not in out
    # classes, top ops grouped by module (the module named once for its two rows), syncs, files
    assert re.search(r"idle\s+│?\s*0\.85\s+│?\s*8\.5%", out)
    assert out.count("model.layers.0.mlp.down_proj") == 1
    assert out.index("model.layers.0.mlp.down_proj") < out.index("model.layers.0.input_layernorm")
    assert re.search(r"mm\s+\[8192, 8192\] x \[8192, 2048\]\s+bfloat16\s+1\.23\s+12\.3%\s+457\s+98\s+1,600\s+46\.2%\s+compute-bound", out)
    assert "train.py:42 (main)" in out and "print(loss.item())" in out
    run_dir = store.latest_run(tmp_path / "runs")
    assert str(run_dir / "summary.json") in out


def test_report_and_runs(capsys, tmp_path):
    root = tmp_path / "runs"
    a = store.save_run(SUMMARY, pd.DataFrame({"op": ["aten::mm"]}), None, root=root, name="20250101-000000-a")
    cpu = SUMMARY | {"device": {"type": "cpu", "name": "x86_64"}, "status": "error", "exit_code": 3,
                     "error": "Traceback ...\nValueError: boom"}
    b = store.save_run(cpu, pd.DataFrame({"op": ["aten::mm"]}), None, root=root, name="20250102-000000-b")
    broken = root / "20250103-000000-broken"
    broken.mkdir()

    code, out, _ = kprof_cli(capsys, "runs", "--out", root)
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert [ln.split()[1] for ln in lines] == [a.name, b.name, broken.name]
    assert "unreadable" in lines[2] and f"{broken / 'summary.json'} is missing" in out

    code, out, _ = kprof_cli(capsys, "report", "--out", root)  # latest readable? no: latest is broken
    assert code == 2

    code, out, _ = kprof_cli(capsys, "report", b.name, "--out", root)
    assert code == 0
    assert "CPU run" in out and "would sync the host with the GPU" in out and "CPU op time 91.5%" in out
    assert "ValueError: boom" in out and "exit code 3" in out

    code, out, _ = kprof_cli(capsys, "report", str(a))
    assert code == 0 and "NVIDIA H200" in out


def test_report_errors_name_the_file(capsys, tmp_path):
    code, _, err = kprof_cli(capsys, "report", tmp_path / "nope")
    assert code == 2 and "nope not found" in err
    code, _, err = kprof_cli(capsys, "report", "--out", tmp_path / "empty")
    assert code == 2 and "no runs in" in err and "kprof profile" in err
    run = store.save_run(SUMMARY, pd.DataFrame({"op": ["aten::mm"]}), None, root=tmp_path)
    (run / "summary.json").write_text("{")
    code, _, err = kprof_cli(capsys, "report", run)
    assert code == 2 and str(run / "summary.json") in err.replace("\n", "") and "corrupt" in err


def test_usage_errors_exit_2(capsys, tmp_path):
    code, _, err = kprof_cli(capsys, "profile", tmp_path / "missing.py", "--out", tmp_path)
    assert code == 2 and "not found" in err and "missing.py" in err
    code, _, err = kprof_cli(capsys, "profile", GPT, "--steps", "0", "--out", tmp_path)
    assert code == 2 and "--steps must be a positive integer" in err
    code, _, err = kprof_cli(capsys, "profile", GPT, "--warmup", "-1", "--out", tmp_path)
    assert code == 2 and "--warmup" in err
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, _, err = kprof_cli(capsys, "profile", GPT, "--out", blocker / "runs")  # fails before running the script
    assert code == 2 and "cannot create the run store" in err
    code, _, err = kprof_cli(capsys, "profile", tmp_path, "--out", tmp_path)
    assert code == 2 and "is a folder" in err
    code, _, _ = kprof_cli(capsys, "profile", GPT, "--step", "sometimes")
    assert code == 2
    code, _, _ = kprof_cli(capsys, "profile")
    assert code == 2


def test_live_progress_follows_runner_events():
    """The runner's progress events (kprof/capture/runner.py run_script docstring) drive one counter per phase."""
    import io

    from rich.progress import Progress

    p = Progress(console=Console(file=io.StringIO(), width=100))
    live = cli._LiveProgress(p)
    live("mode", step_definition="optimizer.step (AdamW)", reason="optimizer.step() was called")
    for phase, total in (("warmup", 2), ("timing", 3), ("profiler-warmup", 1), ("profiling", 3)):
        for i in range(total):
            live("step", phase=phase, index=i, total=total, step=0, last_ms=None)
    live("step", phase="done", index=3, total=3, step=0, last_ms=None)
    live("export", path="x")
    live("analysis")
    live("save")
    done = {t.description: (t.completed, t.total) for t in p.tasks}
    assert done == {"warmup (untimed)": (2, 2), "timed steps": (3, 3), "profiler warm-up": (1, 1),
                    "profiled steps": (3, 3), "saving the run": (0, None)}


def test_calibrate_quick_caches(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KPROF_CACHE_DIR", str(tmp_path))
    code, out, _ = kprof_cli(capsys, "calibrate", "--quick")
    assert code == 0
    cached = list((tmp_path / "ceilings").glob("*.json"))
    assert len(cached) == 1 and f"cached in {cached[0]}" in out
    assert "memory bandwidth" in out and "fp32 peak" in out and "measured by kprof calibrate" in out


@pytest.mark.slow  # a process that imports torch; the fast set starts `python -m kprof` in tests/faults/test_signals.py
def test_python_dash_m(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kprof", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"kprof {kprof.__version__}"


# ---------------------------------------------------------------------------------------------
# End to end: the real runner and analysis on real scripts (CPU here, GPU on the H200).


# Both users of gpt_run are slow (a `kprof profile` process on the GPT example, ~7 s on 2 cores): the
# fast set profiles the same example in-process in tests/test_apply.py and tests/test_suggest.py.
@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """`kprof profile examples/gpt_train.py` once, shared by the assertions below."""
    root = tmp_path_factory.mktemp("runs")
    r = subprocess.run([sys.executable, "-m", "kprof", "profile", str(GPT), "--out", str(root)],
                       capture_output=True, text=True, cwd=REPO, env=_env(), timeout=300)
    return r, root


def _env():
    import os

    return os.environ | {"COLUMNS": "250"}


@pytest.mark.slow
def test_profile_gpt_example_end_to_end(gpt_run):
    r, root = gpt_run
    assert r.returncode == 0, r.stderr
    run = store.load_run(None, root)
    assert sorted(p.name for p in run.path.iterdir()) == ["memory.json.gz", "ops.parquet", "summary.json", "trace.json.gz"]

    s = run.summary
    assert s["status"] == "stopped" and s["steps_recorded"] == 5 and s["warmup"] == 3
    assert s["step_definition"].startswith("optimizer.step")
    assert len(s["step_times_ms"]) == 5 and len(s["profiled_step_times_ms"]) == 5
    assert s["step_time_ms"]["median"] > 0 and s["profiler_overhead_pct"] is not None
    assert s["device"]["type"] in ("cpu", "cuda") and s["ceilings"]["source"]
    assert s["tokens_per_step"] == 8 * 128
    assert 0 < s["coverage_pct"] <= 100 and s["class_breakdown"] and s["top_ops"]
    assert s["kprof_version"] == kprof.__version__

    ops = run.ops
    modules = set(ops["module"])
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "lm_head", "<optimizer>"} <= modules
    assert set(ops["phase"]) >= {"fwd", "bwd", "optim"}
    assert sorted(ops["step"].unique()) == [0, 1, 2, 3, 4]

    # the planted .item() logging line, found at its line
    item_line = next(i for i, ln in enumerate(GPT.read_text().splitlines(), 1) if "loss.item()" in ln)
    syncs = [x for x in s["syncs"] if x["line"] == item_line and Path(x["file"]).name == "gpt_train.py"]
    assert syncs and "item" in syncs[0]["kind"]

    with gzip.open(run.path / "trace.json.gz") as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("kprof.module:transformer.h.0.attn:") for n in names)
    assert any(n.startswith("kprof.step#") for n in names)

    out = r.stdout
    assert "transformer.h." in out and f"gpt_train.py:{item_line}" in out and str(run.path) in out
    assert "step    0  loss" in out  # the script's own output still shows


@pytest.mark.slow
def test_runs_and_report_after_real_profile(gpt_run, capsys):
    _, root = gpt_run
    code, out, _ = kprof_cli(capsys, "runs", "--out", root)
    assert code == 0 and "gpt_train" in out and "optimizer.step" in out
    code, out, _ = kprof_cli(capsys, "report", "--out", root)
    assert code == 0 and "transformer.h." in out


def _script(tmp_path: Path, body: str) -> Path:
    """A tiny training loop (2-layer MLP, AdamW) with `body` run at the end of each step `i`."""
    p = tmp_path / "train_tiny.py"
    p.write_text(textwrap.dedent("""\
        import sys
        import torch
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(8, 16)
        for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        """) + textwrap.indent(textwrap.dedent(body), "    "))
    return p


def test_script_raising_saves_partial_run(capsys, tmp_path):
    # warmup 1 + timed 2, then it raises in the second profiled step
    script = _script(tmp_path, "if i == 4: raise ValueError('planted failure')\n")
    code, out, err = kprof_cli(capsys, "profile", script, "--warmup", "1", "--steps", "2", "--out", tmp_path / "runs")
    assert code != 0
    assert "planted failure" in out + err
    run = store.load_run(None, tmp_path / "runs")
    assert run.summary["status"] == "error" and "ValueError: planted failure" in run.summary["error"]
    assert 1 <= run.summary["steps_recorded"] <= 2 and len(run.ops) > 0


@pytest.mark.parametrize("body, code, status", [
    ("if i == 4: sys.exit(3)\n", 1, "error"),  # 1 whatever the script's own code (named in the error)
    ("if i == 4: raise KeyboardInterrupt\n", 130, "interrupted"),  # Ctrl-C: 128 + SIGINT
])
def test_script_exit_and_interrupt_keep_partial_run(capsys, tmp_path, body, code, status):
    script = _script(tmp_path, body)
    got, _, _ = kprof_cli(capsys, "profile", script, "--warmup", "1", "--steps", "2", "--out", tmp_path / "runs")
    assert got == code
    s = store.load_run(None, tmp_path / "runs").summary
    assert s["status"] == status and s["steps_recorded"] >= 1


def test_analysis_bug_keeps_the_raw_run(capsys, monkeypatch, tmp_path):
    def broken(raw):
        raise ZeroDivisionError("planted analysis bug")

    monkeypatch.setattr("kprof.analyze.profile.analyse", broken)
    script = _script(tmp_path, "")
    code, _, err = kprof_cli(capsys, "profile", script, "--warmup", "0", "--steps", "1", "--out", tmp_path / "runs")
    assert code == 1 and "analysis failed" in err and "planted analysis bug" in err
    run = store.load_run(None, tmp_path / "runs")
    assert str(run.path) in err.replace("\n", "")
    assert "ZeroDivisionError" in run.summary["analysis_error"] and run.summary["steps_recorded"] == 1
    assert run.trace_path is not None and run.ops.empty
    code, out, _ = kprof_cli(capsys, "report", run.path)
    assert code == 0 and "analysis failed" in out


def test_script_raising_before_any_step(capsys, tmp_path):
    script = _script(tmp_path, "if i == 0: raise ValueError('too early')\n")
    code, out, err = kprof_cli(capsys, "profile", script, "--out", tmp_path / "runs")
    assert code != 0 and "too early" in err and "before any step was recorded" in err
    assert store.list_runs(tmp_path / "runs") == []


def test_script_with_syntax_error(capsys, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("def f(:\n")
    code, _, err = kprof_cli(capsys, "profile", script, "--out", tmp_path / "runs")
    assert code == 1 and "SyntaxError" in err and "before any step was recorded" in err


def test_script_system_exit_0_is_fine(capsys, tmp_path):
    script = _script(tmp_path, "if i == 3: sys.exit(0)\n")
    code, _, _ = kprof_cli(capsys, "profile", script, "--warmup", "0", "--steps", "1", "--out", tmp_path / "runs",
                           "--run-to-end")
    assert code == 0
    s = store.load_run(None, tmp_path / "runs").summary
    assert s["status"] == "completed" and s["steps_recorded"] == 1


def test_script_too_short_is_a_clear_error(capsys, tmp_path):
    script = _script(tmp_path, "")
    code, _, err = kprof_cli(capsys, "profile", script, "--out", tmp_path / "runs", "--", "4")
    assert code == 2 and "no step was recorded" in err


# ---------------------------------------------------------------------------------------------
# GPU end to end (run on the H200): the same pipeline on CUDA kernels.


def _profile_subprocess(root: Path, script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kprof", "profile", str(script), "--out", str(root), *args],
                          capture_output=True, text=True, cwd=REPO, env=_env(), timeout=600)


@pytest.mark.gpu
def test_profile_gpt_example_on_gpu(tmp_path):
    r = _profile_subprocess(tmp_path, GPT, "--", "--device", "cuda", "--dtype", "bfloat16", "--batch-size", "16",
                            "--seq-len", "256")
    assert r.returncode == 0, r.stderr
    run = store.load_run(None, tmp_path)
    s = run.summary
    assert s["device"]["type"] == "cuda" and s["steps_recorded"] == 5
    assert s["ceilings"]["kind"] in ("datasheet", "measured") and s["ceilings"]["mem_bw_gbs"] > 0
    assert "max_memory_allocated" in s["peak_memory_kind"] and s["peak_memory_bytes"] > 0
    assert 0 < s["busy_pct"] <= 100 and s["coverage_pct"] >= 95
    assert s["tokens_per_step"] == 16 * 256 and s["tokens_per_s"] > 0
    ops = run.ops
    assert (ops["n_kernels"] > 0).any() and (ops["kernel"] != "").any()
    assert {"transformer.h.0.attn", "lm_head", "<optimizer>"} <= set(ops["module"])
    item_line = next(i for i, ln in enumerate(GPT.read_text().splitlines(), 1) if "loss.item()" in ln)
    assert any(x["line"] == item_line and not x.get("would_sync_on_gpu") for x in s["syncs"])


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_profile_llama_1b_on_gpu(tmp_path):
    script = REPO / "examples" / "llama_train.py"
    r = _profile_subprocess(tmp_path, script, "--warmup", "2", "--steps", "3", "--", "--preset", "1b")
    assert r.returncode == 0, r.stderr
    run = store.load_run(None, tmp_path)
    s = run.summary
    assert s["device"]["type"] == "cuda" and s["steps_recorded"] == 3 and s["coverage_pct"] >= 95
    assert s["tokens_per_step"] == 4 * 2048
    modules = set(run.ops["module"])
    assert {"model.layers.0.mlp.down_proj", "model.layers.7.self_attn.q_proj", "lm_head"} <= modules
    # the matmuls of a 1B model in bf16 on an H200 are compute-bound
    top = pd.DataFrame(s["top_ops"])
    mm = top[top["op"].isin(["aten::mm", "aten::addmm"])]
    assert not mm.empty and (mm["class"] == "compute-bound").any()

"""Runtime diagnoses (kprof.rules.diagnoses.input_pipeline, launch_bound): planted scripts profiled
on the CPU, a hand-written GPU trace for the input-wait measurement, synthetic GPU summaries for
what only a GPU run shows, and the H200 Llama-1B run as the healthy reference."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from planted import SCRIPTS
from planted import planted_line as _line

from kprof.analyze import tables as analysis
from kprof.analyze import trace
from kprof.rules import diagnoses
from kprof.rules.diagnoses import fp32_matmul, host_sync, input_pipeline, launch_bound, unfused_optimizer

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "benchmarks" / "results" / "summary-20261129-190658-llama_train.json"




# These two and the three diagnoses before them: "nothing else fires" is checked against these
# (diagnoses added in parallel are tested in their own files).
CHECKED = [d.DIAGNOSIS for d in (host_sync, fp32_matmul, unfused_optimizer, input_pipeline, launch_bound)]


def diagnose(run):
    return diagnoses.diagnose(run, CHECKED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each planted script profiled once on the CPU (~2 s each)."""
    from kprof.analyze.profile import profile_script

    root = tmp_path_factory.mktemp("runs")
    return {name: profile_script(str(SCRIPTS / f"{name}.py"), ["--iters", "6"], warmup=1, steps=2, out_root=root)
            for name in ("slow_loader", "launch_bound", "adamw_fused")}


# ---------------------------------------------------------------------------------------------
# Planted scripts on the CPU


def test_slow_loader_found_with_its_lines(runs):
    run = runs["slow_loader"]
    d = diagnose(run)
    assert d["id"].tolist() == ["input_pipeline"], d  # fused AdamW, no sync: nothing else
    row = d.iloc[0]
    assert row["source"] == f"{SCRIPTS / 'slow_loader.py'}:{_line('slow_loader.py', 'loader')}"
    det = row["details"][0]
    assert det["iterator"] == "_SingleProcessDataLoaderIter" and det["loader fetches per step"] == 1
    assert det["loader kwargs"]["num_workers"] == "0"
    (copy,) = det["copy sites"]
    assert copy["site"].endswith(f"slow_loader.py:{_line('slow_loader.py', 'h2d')}") and copy["non_blocking"] is False
    # 4 samples x 2 ms of sleep per batch: at least 8 ms/step in __next__, measured from the trace.
    assert det["loader ms/step"] >= 8.0
    assert 0 < row["saving ms/step"] <= det["loader ms/step"]
    assert "num_workers=" in row["how"] and "pin_memory=True" in row["how"] and "non_blocking=True" in row["how"]
    assert row["saving note"].startswith("upper bound") and "CPU run" in row["saving note"]
    # the summary keeps one record per recorded step, each with its fetch
    rows = run.summary["input_wait_by_step"]
    assert [r["step"] for r in rows] == [0, 1] and all(r["loader calls"] == 1 and r["loader (us)"] >= 8000 for r in rows)
    assert all(r["idle (us)"] is None for r in rows)  # CPU run: no device idle to measure


def test_cpu_launch_bound_script_gets_no_finding(runs):
    # A documented choice: on a CPU nothing idles between ops; its ops are latency-bound all the
    # same (the report says so), which a launch-bound diagnosis would flag in every small model.
    run = runs["launch_bound"]
    ops = run.ops
    assert (ops["class"] == "latency-bound").mean() > 0.5
    assert launch_bound.find(ops, run.summary) == []
    assert diagnose(run).empty
    assert run.summary["input_wait_by_step"] == []  # no DataLoader, no copies


def test_clean_script_raises_no_alarm(runs):
    assert diagnose(runs["adamw_fused"]).empty


def test_suggest_cli_shows_the_loader_line(runs, monkeypatch):
    import typer
    from rich.console import Console
    from typer.testing import CliRunner

    from kprof.cli import patch_cmds as cli_patch

    monkeypatch.setattr(cli_patch, "console", Console(width=250))
    monkeypatch.setattr(diagnoses, "DIAGNOSES", CHECKED)
    app = typer.Typer()
    cli_patch.register(app)
    res = CliRunner().invoke(app, ["suggest", str(runs["slow_loader"].path), "--json"])
    assert res.exit_code == 0, res.output
    (diag,) = json.loads(res.output)["diagnoses"]
    assert diag["id"] == "input_pipeline" and diag["saving ms/step"] > 0
    res = CliRunner().invoke(app, ["suggest", str(runs["slow_loader"].path)])
    assert res.exit_code == 0, res.output
    assert "input_pipeline" in res.output and f"slow_loader.py:{_line('slow_loader.py', 'loader')}" in res.output


def test_script_sites_follow_the_batch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "from torch.utils.data import DataLoader\n"
        "val = DataLoader(ds_val)\n"
        "train = torch.utils.data.DataLoader(ds, batch_size=8, pin_memory=True, num_workers=n)\n"
        "for epoch in range(3):\n"
        "    for i, (x, y) in enumerate(train):\n"
        "        x = x.to(dev, non_blocking=True)\n"
        "        y = y.cuda()\n"
        "        extra = {k: v.to(dev) for k, v in y.items()}\n"
        "        w = model.weight.to(dev)\n"  # not the batch
    )
    sites = input_pipeline.script_sites(str(script))
    site, code, kwargs = sites["loader"]
    assert site == f"{script}:4" and code.startswith("train =")  # the iterated loader, not the first one
    assert kwargs == {"batch_size": "8", "pin_memory": "True", "num_workers": "n"}
    assert [(c[0].rsplit(":", 1)[1], c[2]) for c in sites["copies"]] == [("7", True), ("8", False), ("9", False)]
    assert input_pipeline.script_sites(str(tmp_path / "missing.py")) is None


# ---------------------------------------------------------------------------------------------
# The input-wait measurement on a hand-written GPU trace (Kineto's format)

T0 = 1_000_000.0  # us


def _x(name, cat, ts, dur, tid=1, pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur, "args": args}


def _gpu_input_trace() -> dict:
    """One step (host 0-100 us): a DataLoader fetch 2-40 us, then a pageable copy whose
    cudaMemcpyAsync blocks the host 43-58 us (the memcpy itself runs 55-58 us), then a matmul
    (kernel 63-71 us). The previous step's last kernel still runs 0-10 us (no launch event,
    a lower correlation id: it belongs to no recorded step, but the GPU is busy)."""
    return {"traceEvents": [
        _x("kprof.step#0", "user_annotation", 0, 100),
        _x("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 2, 38),
        _x("aten::to", "cpu_op", 41, 19),
        _x("aten::copy_", "cpu_op", 42, 17),
        _x("cudaMemcpyAsync", "cuda_runtime", 43, 15, correlation=2),
        _x("aten::mm", "cpu_op", 61, 5),
        _x("cudaLaunchKernel", "cuda_runtime", 62, 1, correlation=3),
        _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 55, 3, tid=7, pid=0, correlation=2, stream=7, device=0),
        _x("gemm", "kernel", 63, 8, tid=7, pid=0, correlation=3, stream=7, device=0),
        _x("tail_of_previous_step", "kernel", 0, 10, tid=7, pid=0, correlation=1, stream=7, device=0),
    ]}


def test_gpu_input_wait_is_device_idle_inside_fetch_and_copy(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(_gpu_input_trace(), f)
    ev = trace.load_trace(p)
    r = trace.input_ranges(ev)
    assert r[["kind", "name", "dur (us)"]].values.tolist() == [
        ["loader", "_SingleProcessDataLoaderIter", 38.0], ["h2d", "Memcpy HtoD (Pageable -> Device)", 15.0]]
    (w,) = analysis.input_wait_by_step(r, ev.device, ev.steps["step"].tolist()).to_dict(orient="records")
    # fetch 2-40 us, the previous step's kernel runs until 10 us: 38 - 8 idle
    assert w["loader idle (us)"] == pytest.approx(30.0)
    # copy call 43-58 us, the memcpy runs 55-58 us: 15 - 3 idle
    assert w["h2d idle (us)"] == pytest.approx(12.0) and w["idle (us)"] == pytest.approx(42.0)
    assert (w["h2d copies"], w["h2d pageable"], w["h2d device (us)"]) == (1, 1, 3.0)
    # busy intervals on two streams overlap (0-10 and 5-20 us): counted once
    bs, be = analysis._merge([0.0, 5.0, 30.0], [10.0, 20.0, 40.0])
    assert (bs.tolist(), be.tolist()) == ([0.0, 30.0], [20.0, 40.0])
    assert analysis._idle_in([15.0], [35.0], bs, be) == pytest.approx(10.0)  # 20 us, of which 5 + 5 busy
    # CPU run: host times only
    (c,) = analysis.input_wait_by_step(r, None, [0]).to_dict(orient="records")
    assert c["loader (us)"] == 38.0 and math.isnan(c["idle (us)"])


# ---------------------------------------------------------------------------------------------
# Synthetic GPU summaries

H200 = {"device": "NVIDIA H200", "mem_bw_gbs": 4161.0, "latency_us": 14.1, "kind": "measured",
        "peak_tflops": {"fp32": 50.5, "tf32": 387.0, "bf16": 750.0}}


def _gpu_summary(**kw) -> dict:
    s = {"device": {"type": "cuda", "capability": "9.0", "name": "NVIDIA H200"}, "ceilings": H200,
         "steps_recorded": 2, "syncs": [], "module_classes": {"": "Net"}, "script": "/nonexistent/train.py",
         "profiled_step_time_ms": {"median": 1.0}, "step_time_ms": {"median": 1.0},
         "idle_by_step": [{"step": s, "window (us)": 1000.0, "busy (us)": 200.0, "idle (us)": 800.0} for s in (0, 1)],
         "input_wait_by_step": []}
    return s | kw


def _kernels(us_per_launch: float = 3.0, name: str = "elementwise_kernel") -> pd.DataFrame:
    # per step: 150 ops of 2 short kernels each, and one 100 us matmul
    rows = []
    for step in (0, 1):
        rows += [{"step": step, "op": "aten::add", "n_kernels": 2, "device_time (us)": 2 * us_per_launch,
                  "kernel": name} for _ in range(150)]
        rows.append({"step": step, "op": "aten::mm", "n_kernels": 1, "device_time (us)": 100.0, "kernel": "gemm"})
    return pd.DataFrame(rows)


def test_launch_bound_saving_is_the_idle():
    (f,) = launch_bound.find(_kernels(), _gpu_summary())
    assert f.saving_ms == pytest.approx(0.8) and f.ms_per_step == pytest.approx(0.8)
    det = f.details[0]
    assert det["kernels per step"] == 301 and det["short share"] == pytest.approx(300 / 301)
    assert det["median kernel us"] == 3.0
    assert f.confidence == "high" and "reduce-overhead" in f.how and f.where == "whole step (Net)"
    assert "80% of the 1.000 ms step" in f.evidence


def test_launch_bound_leaves_out_data_waits_and_profiler_overhead():
    waits = [{"step": s, "idle (us)": 200.0} for s in (0, 1)]
    (f,) = launch_bound.find(_kernels(), _gpu_summary(input_wait_by_step=waits))
    assert f.saving_ms == pytest.approx(0.6)  # 800 us idle - 200 us waiting for data
    assert "waiting for data" in f.evidence
    # Unprofiled steps of 0.5 ms: the profiler added 500 us of host time; busy stays 200 us.
    (f,) = launch_bound.find(_kernels(), _gpu_summary(step_time_ms={"median": 0.5}))
    assert f.saving_ms == pytest.approx(0.3) and "unprofiled step time" in f.saving_note


def test_launch_bound_confidence_and_compiled_models():
    syncs = [{"kind": "Tensor.item", "file": "/x/train.py", "line": 3, "count": 2}]
    (f,) = launch_bound.find(_kernels(), _gpu_summary(syncs=syncs))
    assert f.confidence == "medium" and "host syncs" in f.saving_note
    (f,) = launch_bound.find(_kernels(), _gpu_summary(ceilings=H200 | {"kind": "default"}))
    assert f.confidence == "low"  # the latency threshold is a guess
    (f,) = launch_bound.find(_kernels(name="triton_poi_fused_add_0"), _gpu_summary())
    assert f.how.startswith("already compiled")


@pytest.mark.parametrize("case", ["cpu", "long_kernels", "little_idle", "idle_is_data", "no_idle_record"])
def test_launch_bound_no_false_alarm(case):
    ops, s = _kernels(), _gpu_summary()
    if case == "cpu":
        s["device"] = {"type": "cpu"}
    elif case == "long_kernels":  # idle, but between 50 us kernels: something else stalls
        ops = _kernels(us_per_launch=50.0)
    elif case == "little_idle":  # 5% idle
        s["idle_by_step"] = [{"step": t, "window (us)": 1000.0, "busy (us)": 950.0, "idle (us)": 50.0} for t in (0, 1)]
    elif case == "idle_is_data":  # 750 of the 800 us idle is spent waiting for the DataLoader
        s["input_wait_by_step"] = [{"step": t, "idle (us)": 750.0} for t in (0, 1)]
    elif case == "no_idle_record":
        s["idle_by_step"] = []
    assert launch_bound.find(ops, s) == []


def test_input_pipeline_on_gpu_saving_is_measured_idle():
    rows = [{"step": s, "iterator": "_SingleProcessDataLoaderIter", "loader calls": 1, "loader (us)": 9000.0,
             "loader idle (us)": idle - 100.0, "h2d copies": 1, "h2d pageable": 1, "h2d host (us)": 150.0,
             "h2d device (us)": 5.0, "h2d idle (us)": 100.0, "idle (us)": idle}
            for s, idle in enumerate((8000.0, 8500.0, 30000.0))]
    s = _gpu_summary(input_wait_by_step=rows, profiled_step_time_ms={"median": 10.0},
                     step_time_ms={"median": 10.0}, steps_recorded=3,
                     idle_by_step=[{"step": t, "window (us)": 10000.0, "busy (us)": 1500.0,
                                    "idle (us)": 8500.0} for t in range(3)],
                     script=str(SCRIPTS / "slow_loader.py"))
    (f,) = input_pipeline.find(pd.DataFrame(), s)
    assert f.saving_ms == pytest.approx(8.5)  # median over steps of the idle inside fetch + copy
    assert f.saving_note.startswith("measured") and f.confidence == "high"
    assert "copies: 1/step (1 from pageable memory)" in f.evidence and "pin_memory=True" in f.how
    # 9 ms of loading per 1.5 ms of the rest of the step: 6 workers keep up
    assert f.details[0]["workers needed"] == 6 and "num_workers=6" in f.how
    assert f.source.endswith(f"slow_loader.py:{_line('slow_loader.py', 'loader')}")


@pytest.mark.parametrize("case", ["no_loader", "fast_loader", "cpu_fast"])
def test_input_pipeline_no_false_alarm(case):
    fast = [{"step": s, "iterator": "_SingleProcessDataLoaderIter", "loader calls": 1, "loader (us)": 60.0,
             "loader idle (us)": 40.0, "h2d copies": 1, "h2d pageable": 1, "h2d host (us)": 10.0, "h2d device (us)": 2.0,
             "h2d idle (us)": 5.0, "idle (us)": 45.0} for s in (0, 1)]
    s = _gpu_summary(input_wait_by_step=[] if case == "no_loader" else fast)
    if case == "cpu_fast":  # 60 us in __next__ of a 2 ms CPU step: 3%, under the 5% bar
        s |= {"device": {"type": "cpu", "cpu_count": 2}, "profiled_step_time_ms": {"median": 2.0},
              "step_time_ms": {"median": 2.0},
              "idle_by_step": [{"step": t, "window (us)": 2000.0, "busy (us)": 1900.0, "idle (us)": 100.0}
                               for t in (0, 1)]}
    assert input_pipeline.find(pd.DataFrame(), s) == []


# ---------------------------------------------------------------------------------------------
# The healthy reference: Llama-1B on the H200 (about 2% idle in its steady steps)


def _llama_ops(summary: dict) -> pd.DataFrame:
    """An op table re-derived from the summary's class breakdown: per class, its ops/step with the
    class's mean time each, one kernel per op (the parquet of that run is not kept)."""
    rows = []
    for r in summary["class_breakdown"]:
        if r["class"] == "idle":
            continue
        k = round(r["ops/step"])
        rows += [{"step": s, "op": r["class"], "n_kernels": 1, "device_time (us)": r["time/step (ms)"] * 1e3 / k,
                  "kernel": "k"} for s in range(summary["steps_recorded"]) for _ in range(k)]
    return pd.DataFrame(rows)


def test_llama_gpu_run_raises_no_alarm():
    s = json.loads(LLAMA.read_text())
    ops = _llama_ops(s)
    assert len(ops) / s["steps_recorded"] == pytest.approx(985, abs=1)
    for d in (launch_bound, input_pipeline):
        assert d.find(ops, s) == [] and d.find(pd.DataFrame(), s) == []
    # Not only because it idles little: with 60% idle its kernel mix (21% short) still isn't launch-bound.
    idle = [r | {"idle (us)": 0.6 * r["window (us)"], "busy (us)": 0.4 * r["window (us)"]} for r in s["idle_by_step"]]
    assert launch_bound.kernel_stats(ops, s, s["ceilings"]["latency_us"])["short share"] < launch_bound.MIN_SHORT_SHARE
    assert launch_bound.find(ops, s | {"idle_by_step": idle, "step_time_ms": None}) == []


# ---------------------------------------------------------------------------------------------
# GPU: the planted scripts where the costs are real (run on the H200)


@pytest.mark.gpu
def test_gpu_slow_loader_idle_measured(tmp_path):
    from kprof.analyze.profile import profile_script

    run = profile_script(str(SCRIPTS / "slow_loader.py"), ["--device", "cuda", "--iters", "12"], warmup=2, steps=3,
                         out_root=tmp_path)
    d = diagnose(run).set_index("id")
    assert "input_pipeline" in d.index, diagnose(run)
    row = d.loc["input_pipeline"]
    det = row["details"][0]
    assert row["saving note"].startswith("measured")
    # The GPU idles for most of the 8 ms of sleep per batch, and the batch copy is pageable. The
    # saving is the median over steps of (loader + copy) idle, the details are medians of each
    # part: median(a + b) can exceed median(a) + median(b) (H200 run: 8.954 vs 8.906 + 0.047), so
    # the bound is the parts' largest step, not their medians' sum.
    per_step = run.summary["input_wait_by_step"]
    worst = max(float(r.get("loader (us)") or 0) + float(r.get("h2d host (us)") or 0) for r in per_step) / 1e3
    assert 4.0 < row["saving ms/step"] <= worst, (row["saving ms/step"], per_step)
    assert det["h2d pageable per step"] >= 1 and "pin_memory=True" in row["how"]
    if "launch_bound" in d.index:  # the tiny MLP may be launch-bound too, but not for the data wait
        assert d.loc["launch_bound", "saving ms/step"] < row["saving ms/step"]


@pytest.mark.gpu
def test_gpu_launch_bound_found(tmp_path):
    from kprof.analyze.profile import profile_script

    run = profile_script(str(SCRIPTS / "launch_bound.py"), ["--device", "cuda", "--iters", "12"], warmup=2, steps=3,
                         out_root=tmp_path)
    d = diagnose(run).set_index("id")
    assert "launch_bound" in d.index, diagnose(run)
    row = d.loc["launch_bound"]
    det = row["details"][0]
    assert det["short share"] >= launch_bound.MIN_SHORT_SHARE and det["kernels per step"] > 100
    assert 0 < row["saving ms/step"] <= det["idle ms/step"]
    assert row["source"].endswith(f"launch_bound.py:{_line('launch_bound.py', 'model')}")
    assert "input_pipeline" not in d.index

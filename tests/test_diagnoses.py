"""Diagnoses beyond kernels (kprof.rules.diagnoses): planted scripts profiled on the CPU (one
problem each, and a clean one), and synthetic op tables for what only a GPU run shows."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from planted import SCRIPTS
from planted import planted_line as _line

from kprof.rules.diagnoses import diagnose, fp32_matmul, host_sync, unfused_optimizer
from kprof.rules.diagnoses.unfused_optimizer import elements


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each planted script profiled once (CPU: ~3 s each)."""
    from kprof.analyze.profile import profile_script

    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name in ("item_sync", "adamw_loop", "adamw_foreach", "adamw_fused"):
        out[name] = profile_script(str(SCRIPTS / f"{name}.py"), ["--iters", "7"], warmup=1, steps=2, out_root=root)
    return out


def _ids(run) -> list[str]:
    return diagnose(run)["id"].tolist()


# ---------------------------------------------------------------------------------------------
# Planted scripts


def test_item_in_loop_found_at_its_line(runs):
    d = diagnose(runs["item_sync"])
    assert d["id"].tolist() == ["host_sync"]  # fused optimizer, CPU run: nothing else
    row = d.iloc[0]
    line = _line("item_sync.py", "item-sync")
    assert row["source"] == f"{SCRIPTS / 'item_sync.py'}:{line}"
    site = row["details"][0]
    assert site["kind"] == "Tensor.item" and site["line"] == line and site["per step"] == 1.0
    assert "loss.item()" in site["code"] and "every N steps" in site["fix"]
    # A CPU run can't measure what the sync costs: no number is made up.
    assert math.isnan(row["saving ms/step"]) and "CPU run" in row["saving note"]


@pytest.mark.parametrize("script, kind", [("adamw_loop", "for-loop"), ("adamw_foreach", "foreach")])
def test_unfused_adamw_flagged_with_fused_fix(runs, script, kind):
    d = diagnose(runs[script])
    assert d["id"].tolist() == ["unfused_optimizer"]
    row = d.iloc[0]
    assert row["where"] == f"optimizer AdamW ({kind})"
    assert row["source"] == f"{SCRIPTS / (script + '.py')}:{_line(script + '.py', 'optimizer')}"
    assert row["how"].endswith("torch.optim.AdamW(..., fused=True)")
    det = row["details"][0]
    # Linear(8, 16) + Linear(16, 4): 8*16 + 16 + 16*4 + 4 parameters, counted from the op shapes.
    assert det["parameter elements"] == 212 and det["accepts fused"] is True
    assert row["ms/step"] > 0 and 0 <= row["saving ms/step"] <= row["ms/step"]


def test_clean_script_raises_no_alarm(runs):
    assert _ids(runs["adamw_fused"]) == []


def test_cpu_run_gets_no_tf32_advice(runs):
    # fp32 matmuls are there (the MLP), but a CPU has no tensor cores.
    assert len(fp32_matmul.fp32_matmuls(runs["adamw_fused"].ops)) > 0
    assert "fp32_matmul" not in _ids(runs["adamw_loop"])


def test_suggest_cli_lists_diagnoses_after_kernel_rules(runs, monkeypatch):
    import typer
    from rich.console import Console
    from typer.testing import CliRunner

    from kprof.cli import patch_cmds as cli_patch
    from kprof.plan.suggest import load_plan

    monkeypatch.setattr(cli_patch, "console", Console(width=250))
    app = typer.Typer()
    cli_patch.register(app)
    run = runs["item_sync"]
    res = CliRunner().invoke(app, ["suggest", str(run.path), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [s["id"] for s in doc["diagnoses"]] == ["host_sync"]
    assert all(s["id"] != "host_sync" for s in doc["suggestions"])  # apply never sees diagnoses
    assert load_plan(run)["diagnoses"] == doc["diagnoses"]
    res = CliRunner().invoke(app, ["suggest", str(run.path)])
    assert res.exit_code == 0, res.output
    assert "host_sync" in res.output and f"item_sync.py:{_line('item_sync.py', 'item-sync')}" in res.output


# ---------------------------------------------------------------------------------------------
# Synthetic tables (what a GPU run records)

H200 = {"device": "NVIDIA H200", "mem_bw_gbs": 4161.0, "latency_us": 14.1, "kind": "measured",
        "peak_tflops": {"fp32": 50.5, "tf32": 387.0, "bf16": 750.0}}


def _gpu_summary(**kw) -> dict:
    s = {"device": {"type": "cuda", "capability": "9.0", "name": "NVIDIA H200"}, "ceilings": H200,
         "steps_recorded": 2, "profiled_step_time_ms": {"median": 100.0}, "syncs": [], "idle_by_step": []}
    return s | kw


def _mm(module, us, flops, nbytes, dtype_class="fp32", kernel="sm90_xmma_gemm_f32f32_f32f32_f32", step=0, phase="fwd"):
    return {"step": step, "module": module, "phase": phase, "op": "aten::mm", "tensor_core": True,
            "dtype class": dtype_class, "flops": flops, "bytes": nbytes, "device_time (us)": us, "kernel": kernel}


def _matmul_table(**kw) -> pd.DataFrame:
    # 2 steps x (a 4096^3 fp32 matmul at 3000 us (45.8 TFLOP/s, under the 50.5 fp32 peak) + a
    # launch-only linear row with no FLOPs, which must be ignored).
    rows = []
    for step in (0, 1):
        rows.append(_mm("blk.0.mlp.up", 3000.0, 2 * 4096**3, 3 * 4096**2 * 4, step=step, **kw))
        rows.append(_mm("blk.0.mlp.up", 5.0, 0.0, 0.0, step=step, **kw) | {"op": "aten::linear"})
    return pd.DataFrame(rows)


def test_fp32_matmul_on_gpu_saving_from_the_tf32_peak():
    (f,) = fp32_matmul.find(_matmul_table(), _gpu_summary())
    # per step: 3000 us measured; at tf32: max(2*4096^3 / 387e12, 3*4096^2*4 / 4161e9) s
    at_tf32 = max(2 * 4096**3 / 387e12, 3 * 4096**2 * 4 / 4161e9) * 1e6
    assert f.ms_per_step == pytest.approx(3.0)
    assert f.saving_ms == pytest.approx((3000.0 - at_tf32) / 1e3)
    assert f.where == "blk.0.mlp.up" and "allow_tf32 = True" in f.how and "autocast" in f.how
    assert "1 fp32 matmuls/step" in f.evidence and f.confidence == "high"


@pytest.mark.parametrize("case", ["cpu", "volta", "bf16", "tf32_kernel", "faster_than_fp32", "below_1pct",
                                  "launch_bound"])
def test_fp32_matmul_no_false_alarm(case):
    table, summary = _matmul_table(), _gpu_summary()
    if case == "cpu":
        summary["device"] = {"type": "cpu", "capability": None}
    elif case == "volta":  # no TF32/bf16 tensor cores before sm_80
        summary["device"]["capability"] = "7.0"
    elif case == "bf16":
        table = _matmul_table(dtype_class="bf16")
    elif case == "tf32_kernel":  # TF32 already on: cuBLAS names the kernel
        table = _matmul_table(kernel="sm90_xmma_gemm_f32f32_tf32f32_f32")
    elif case == "faster_than_fp32":  # 137 TFLOP/s from "fp32" inputs: tensor cores are in use
        table["device_time (us)"] = table["device_time (us)"] / 3
    elif case == "below_1pct":  # 3 ms of matmul in a 10 s step
        summary["profiled_step_time_ms"] = {"median": 10_000.0}
    elif case == "launch_bound":  # a tiny model's 8 us matmuls: under the 14.1 us launch latency at any peak
        table = pd.DataFrame([_mm("head", 8.0, 2 * 4 * 16 * 64, 4 * (4 * 16 + 16 * 64 + 4 * 64), step=s) for s in (0, 1)])
        summary["profiled_step_time_ms"] = {"median": 0.5}
    assert fp32_matmul.find(table, summary) == []


def test_host_sync_on_gpu_bounded_by_idle_time():
    syncs = [{"kind": "Tensor.item", "file": "/x/train.py", "line": 40, "code": "print(loss.item())", "count": 2,
              "steps": [0, 1]},
             {"kind": "torch.nonzero (data-dependent shape)", "file": "/x/model.py", "line": 7, "code": "idx = m.nonzero()",
              "count": 8, "steps": [0, 1]}]
    idle = [{"step": 0, "idle (us)": 1500.0}, {"step": 1, "idle (us)": 2500.0}, {"step": 2, "idle (us)": 9000.0}]
    (f,) = host_sync.find(pd.DataFrame(), _gpu_summary(syncs=syncs, idle_by_step=idle, steps_recorded=2))
    assert f.saving_ms == pytest.approx(2.5)  # median of the per-step idle times
    assert f.saving_note.startswith("upper bound")
    # busiest site first, each with its own fix
    assert [(d["line"], d["per step"]) for d in f.details] == [(7, 4.0), (40, 1.0)]
    assert "torch.where" in f.details[0]["fix"] and "every N steps" in f.details[1]["fix"]
    assert f.source == "/x/model.py:7"


def test_host_sync_saving_never_exceeds_the_unprofiled_step():
    # issue 22: "<= 424 ms/step" on a 180 ms step (idle measured in the slower profiled steps)
    syncs = [{"kind": "Tensor.item", "file": "/x/train.py", "line": 40, "code": "loss.item()", "count": 2,
              "steps": [0, 1]}]
    idle = [{"step": 0, "idle (us)": 424e3}, {"step": 1, "idle (us)": 424e3}]
    summary = _gpu_summary(syncs=syncs, idle_by_step=idle, step_time_ms={"median": 180.0},
                           profiled_step_time_ms={"median": 500.0})
    (f,) = host_sync.find(pd.DataFrame(), summary)
    assert f.saving_ms == pytest.approx(180.0) and "whole unprofiled step" in f.saving_note


def test_no_syncs_no_finding():
    assert host_sync.find(pd.DataFrame(), _gpu_summary()) == []


def test_optimizer_element_count_and_classification():
    # foreach's first argument is a tensor list; mul(scalar, g, g) counts g; step counters are 0-dim.
    assert elements([[[16, 8], [16]], []]) == 144
    assert elements([[], [4, 16], [4, 16]]) == 64
    assert elements([[[], [], []], []]) == 3
    rows = [{"step": 0, "phase": "optim", "op": op, "input_shapes": shapes, "input_dtypes": ["float"],
             "device_time (us)": 1.0, "op_id": i, "parent_id": parent}
            for i, (op, shapes, parent) in enumerate([
                ("aten::_foreach_add_", [[[], []], []], -1),  # step counters: not parameter work
                ("aten::_fused_adamw_", [[[16, 8], [16]], [[16, 8], [16]]], -1),
                ("aten::_foreach_lerp_", [[[16, 8], [16]], [[16, 8], [16]], []], -1),
                ("aten::lerp_", [[16, 8], [16, 8], []], 2),  # CPU foreach slow path: a child
                ("aten::addcdiv_", [[16], [16], [16], []], -1)])]
    o = unfused_optimizer.optimizer_ops(pd.DataFrame(rows))
    assert o["kind"].tolist() == ["other", "fused", "foreach", "foreach-child", "loop"]


def test_json_records_are_finite():
    from kprof.plan.suggest import plan_records

    recs = plan_records(pd.DataFrame([{"a": math.nan, "details": [{"b": math.nan, "c": [1.0, math.inf]}]}]))
    assert recs == [{"a": None, "details": [{"b": None, "c": [1.0, None]}]}]
    json.dumps(recs, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# GPU: the same planted scripts where the costs are real (run on the H200)


@pytest.mark.gpu
def test_gpu_fp32_matmul_flagged_and_tf32_run_not(tmp_path):
    from kprof.analyze.profile import profile_script

    script = str(SCRIPTS / "fp32_matmul.py")
    # 2 warm-up + 3 timed + 1 profiler warm-up + 3 recorded + the shapes step (its end is the 11th optimizer step)
    off = profile_script(script, ["--iters", "11"], warmup=2, steps=3, out_root=tmp_path)
    d = diagnose(off).set_index("id")
    assert "fp32_matmul" in d.index, diagnose(off)
    row = d.loc["fp32_matmul"]
    assert 0 < row["saving ms/step"] < row["ms/step"]
    on = profile_script(script, ["--tf32", "--iters", "11"], warmup=2, steps=3, out_root=tmp_path)
    assert "fp32_matmul" not in _ids(on)


@pytest.mark.gpu
def test_gpu_item_sync_saving_bounded_by_idle(tmp_path):
    from kprof.analyze.profile import profile_script

    run = profile_script(str(SCRIPTS / "item_sync.py"), ["--iters", "8", "--device", "cuda"], warmup=2, steps=3,
                         out_root=tmp_path)
    d = diagnose(run)
    # A tiny MLP on an H200 is launch-bound too: launch_bound may fire beside the sync.
    assert "host_sync" in d["id"].tolist(), (d, run.summary["status"], run.summary["steps_recorded"],
                                             run.summary["device"].get("type"), run.summary["syncs"])
    row = d.set_index("id").loc["host_sync"]
    assert row["details"][0]["line"] == _line("item_sync.py", "item-sync")
    assert row["saving note"].startswith("upper bound") and row["saving ms/step"] >= 0


def test_cpu_script_on_a_gpu_machine_is_a_cpu_run(tmp_path, monkeypatch):
    # H200, 2026-11-29: item_sync.py (CPU tensors) profiled on the GPU machine was taken for a GPU
    # run, and its host idle time reported as recoverable GPU idle time. The trace decides.
    import kprof.capture.runner as runner
    from kprof.analyze.profile import profile_script

    real = runner.device_info

    def gpu_machine(use_cuda=None):
        if use_cuda is False:
            return real(use_cuda=False)
        return real(use_cuda=False) | {"type": "cuda", "name": "Fake H200", "sm_count": 132}

    monkeypatch.setattr(runner, "device_info", gpu_machine)
    run = profile_script(str(SCRIPTS / "item_sync.py"), ["--iters", "6"], warmup=1, steps=2, out_root=tmp_path)
    dev = run.summary["device"]
    assert dev["type"] == "cpu" and dev["unused_gpu"] == "Fake H200"
    row = diagnose(run).iloc[0]
    assert math.isnan(row["saving ms/step"]) and "CPU run" in row["saving note"]

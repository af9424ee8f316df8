"""Issue 2's GPU acceptance checks on the Llama example (run on the H200; skipped without CUDA).

One profile of `examples/llama_train.py --preset 1b` serves all checks: coverage >= 95%, matmuls
compute-bound, softmax/norm/elementwise memory-bound, and kprof's step time within 10% of an
independent CUDA-event timing of the same script (tests/profile/plain_timing.py).
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
LLAMA = REPO / "examples" / "llama_train.py"
MEMORY_OPS = {"aten::mul", "aten::add", "aten::_softmax", "aten::_log_softmax", "aten::silu", "aten::pow",
              "aten::mean", "aten::rsqrt", "aten::neg", "aten::cat", "aten::_to_copy", "aten::copy_",
              "aten::silu_backward", "aten::_log_softmax_backward_data", "aten::_softmax_backward_data"}


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    from kprof import store

    tmp = tmp_path_factory.mktemp("llama")
    r = subprocess.run(
        [sys.executable, "-m", "kprof", "profile", str(LLAMA), "--out", str(tmp / "runs"),
         "--", "--preset", "1b", "--device", "cuda", "--steps", "20"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return store.load_run(None, tmp / "runs")


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_llama_coverage_at_least_95(llama_run):
    assert llama_run.summary["coverage_pct"] >= 95, llama_run.summary["coverage_pct"]


def _time_by_class(ops: pd.DataFrame, opnames) -> pd.Series:
    sel = ops[ops["op"].isin(opnames)]
    return sel.groupby("class")["device_time (us)"].sum()


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_llama_matmuls_compute_bound(llama_run):
    by = _time_by_class(llama_run.ops, {"aten::mm", "aten::addmm", "aten::bmm"})
    assert by.sum() > 0
    # time-weighted: most matmul time is compute-bound on a 1B bf16 model at 8K tokens/step
    assert by.get("compute-bound", 0) / by.sum() > 0.8, by.to_dict()


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_llama_norm_softmax_elementwise_memory_bound(llama_run):
    by = _time_by_class(llama_run.ops, MEMORY_OPS)
    assert by.sum() > 0
    assert by.get("memory-bound", 0) / by.sum() > 0.8, by.to_dict()
    assert by.get("compute-bound", 0) == 0, by.to_dict()


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_llama_step_time_matches_plain_cuda_event_timing(llama_run, tmp_path):
    out = tmp_path / "plain.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "profile" / "plain_timing.py"), str(out), str(LLAMA),
         "--preset", "1b", "--device", "cuda", "--steps", "14"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plain = json.loads(out.read_text())[3:]  # same warm-up as kprof's default
    plain_ms = statistics.median(plain)
    kprof_ms = llama_run.summary["step_time_ms"]["median"]
    assert abs(kprof_ms - plain_ms) / plain_ms < 0.10, (kprof_ms, plain_ms, plain)

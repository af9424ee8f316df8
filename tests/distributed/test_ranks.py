"""Multi-process jobs (issue 25, CPU part): the communication and rank analysis on planted
intervals and summaries, then a real 2-rank gloo DDP job profiled end to end, launched by kprof
(--nproc-per-node) and by the user's own torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kprof.analyze.distributed import communication, exposed_us, merge_ranks

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ddp_tiny.py"


# ---------------------------------------------------------------------------------------------
# Pure functions


def test_exposed_is_the_part_no_other_work_covers():
    # comm 0-10 and 20-30; compute 5-25 covers 5 of the first and 5 of the second
    assert exposed_us([(0, 10), (20, 30)], [(5, 25)]) == (10.0, 10.0)
    assert exposed_us([(0, 10)], []) == (10.0, 0.0)
    assert exposed_us([(0, 10), (2, 4)], [(0, 3), (2, 6)]) == (4.0, 6.0)  # overlapping inputs merge


def _kernels(rows):
    df = pd.DataFrame(rows, columns=["step", "name", "ts (us)", "dur (us)", "stream"])
    df["end (us)"] = df["ts (us)"] + df["dur (us)"]
    return df


def test_communication_on_a_gpu_timeline():
    # Per step: an NCCL all-reduce on stream 20 (100 us) beside a GEMM on stream 7 that covers
    # 60 us of it; broadcast_tensors on the compute stream is not communication.
    rows = []
    for step, t0 in ((0, 0.0), (1, 1000.0)):
        rows += [(step, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", t0 + 100, 100.0, 20),
                 (step, "sm90_xmma_gemm_bf16", t0 + 40, 120.0, 7),
                 (step, "aten::broadcast_tensors", t0 + 300, 5.0, 7)]
    c = communication(_kernels(rows), 2)
    assert c["collectives per step"] == 1 and c["kinds"] == ["all-reduce"]
    assert c["comm ms/step"] == pytest.approx(0.100)
    assert c["overlapped ms/step"] == pytest.approx(0.060) and c["exposed ms/step"] == pytest.approx(0.040)


def test_no_collectives_no_section():
    assert communication(_kernels([(0, "aten::mm", 0.0, 10.0, 1)]), 1) is None


def _summary(rank, step_ms, comm_ms):
    return {"rank": rank, "status": "stopped", "step_time_ms": {"median": step_ms},
            "profiled_step_time_ms": {"median": step_ms * 1.5},
            "communication": {"comm ms/step": comm_ms, "exposed ms/step": comm_ms}, "busy_pct": 50.0}


def test_merge_names_the_slowest_rank_and_the_straggler():
    # Rank 2 computes longest and arrives last: the others wait ~4 ms in the all-reduce.
    m = merge_ranks([_summary(0, 20.0, 5.0), _summary(1, 20.5, 5.2), _summary(2, 21.0, 1.0)], 4)
    assert [r["rank"] for r in m["ranks"]] == [0, 1, 2] and m["missing_ranks"] == [3]
    assert m["slowest rank"] == 2 and m["skew %"] == pytest.approx(100 * 1.0 / 20.5)
    assert m["straggler"]["rank"] == 2 and m["straggler"]["others wait ms/step"] == pytest.approx(4.1)


def test_merge_names_no_straggler_when_the_wait_is_noise():
    m = merge_ranks([_summary(0, 20.0, 5.0), _summary(1, 20.1, 4.9)], 2)
    assert m["straggler"] is None and m["missing_ranks"] == []


# ---------------------------------------------------------------------------------------------
# A real job: 2 ranks, gloo, on the CPU


def _kprof(args, cwd, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} | (env or {})
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _check_merged(root: Path):
    (run,) = [p for p in root.iterdir() if not p.name.startswith(".")]  # one run, no staging left
    s = json.loads((run / "summary.json").read_text())
    d = s["distributed"]
    assert s["world_size"] == 2 and d["world_size"] == 2 and d["missing_ranks"] == []
    assert [r["rank"] for r in d["ranks"]] == [0, 1]
    assert all(r["step ms"] > 0 and r["comm ms/step"] > 0 for r in d["ranks"])  # DDP all-reduces every step
    for r in (0, 1):
        rank_run = run / "ranks" / f"rank{r}"
        assert (rank_run / "trace.json.gz").is_file() and (rank_run / "ops.parquet").is_file()
        rs = json.loads((rank_run / "summary.json").read_text())
        assert rs["rank"] == r and rs["communication"]["kinds"] == ["all-reduce"]
    assert not list(root.glob(".ranks-*"))
    return run


# slow: two ranks and `kprof report`, each a process that imports torch (~15 s on 2 cores); the fast set
# checks the merge and the rank analysis on planted ranks above
@pytest.mark.slow
def test_nproc_per_node_profiles_every_rank_and_merges(tmp_path):
    p = _kprof(["kprof", "profile", str(SCRIPT), "--warmup", "1", "--steps", "2", "--out", str(tmp_path / "runs"),
                "--nproc-per-node", "2"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 ranks" in p.stdout and "rank 1 of 2 recorded" in p.stderr
    run = _check_merged(tmp_path / "runs")
    r = _kprof(["kprof", "report", run.name, "--out", str(tmp_path / "runs")], cwd=tmp_path,
               env={"COLUMNS": "80"})
    assert r.returncode == 0 and "2 ranks" in r.stdout and "slowest rank" in r.stdout


@pytest.mark.slow
def test_under_the_users_own_torchrun(tmp_path):
    p = _kprof(["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "kprof", "profile",
                str(SCRIPT), "--warmup", "1", "--steps", "2", "--out", str(tmp_path / "runs")], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_merged(tmp_path / "runs")


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "0"], "at least 1"),
    (["--nproc-per-node", "2", "--json"], "--json and --ncu go with one process"),
])
def test_bad_nproc_input(tmp_path, capsys, args, message):
    from kprof.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", str(SCRIPT), "--out", str(tmp_path / "runs"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err

"""Faults in the run store: read-only, missing, a file, full, corrupt summaries, a truncated
trace, two processes writing at once. One line and the documented exit code each; the other
runs stay listed and intact (tests/faults/faultkit.py)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import shutil

import pandas as pd
import pytest

from faultkit import ReadOnly, check, digest, flat, kprof, runs_intact, script
from kprof import store

FAST = ["--warmup", "1", "--steps", "1"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One real profiled run of a tiny script; tests copy its store."""
    base = tmp_path_factory.mktemp("profiled")
    s = script(base, "")
    res = kprof("profile", s, *FAST, "--out", base / "runs")
    assert res.code == 0, res.err
    return base


@pytest.fixture
def runs(profiled, tmp_path):
    shutil.copytree(profiled / "runs", tmp_path / "runs")
    shutil.copy(profiled / "train.py", tmp_path / "train.py")
    return tmp_path / "runs"


def test_store_read_only_profile(runs, tmp_path):
    before = digest(runs, tmp_path / "train.py")
    with ReadOnly(runs):
        res = kprof("profile", script(tmp_path, "if i == 0: raise SystemExit('must not run')\n", name="other.py"),
                    *FAST, "--out", runs)
    check(res, "store_read_only_profile")
    assert "must not run" not in res.text  # refused before the script ran
    assert digest(runs, tmp_path / "train.py") == before


def test_store_read_only_suggest(runs):
    (run,) = store.list_runs(runs)
    before = digest(runs)
    with ReadOnly(run):
        res = kprof("suggest", "--out", runs)
    check(res, "store_read_only_suggest")
    assert "unfused_optimizer" in flat(res.out)  # the plan is still shown
    assert digest(runs) == before


def test_store_read_only_apply(runs, tmp_path):
    before = digest(runs, tmp_path / "train.py")
    with ReadOnly(runs):
        res = kprof("apply", tmp_path / "train.py", "--out", runs)
    check(res, "store_read_only_apply")
    assert digest(runs, tmp_path / "train.py") == before


def test_store_missing(tmp_path):
    s = script(tmp_path, "")
    for args in (["suggest"], ["report"], ["apply", s]):
        res = kprof(*args, "--out", tmp_path / "nowhere")
        check(res, "store_missing")
    assert not (tmp_path / "nowhere").exists()
    res = kprof("runs", "--out", tmp_path / "nowhere")
    assert res.code == 0 and "no runs in" in res.out


def test_store_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a folder\n")
    res = kprof("profile", script(tmp_path, ""), *FAST, "--out", tmp_path / "runs")
    check(res, "store_is_a_file")
    assert (tmp_path / "runs").read_text() == "not a folder\n"


def test_store_full(runs, tmp_path, monkeypatch):
    def full(ops, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_ops", full)
    before = digest(runs)
    res = kprof("profile", tmp_path / "train.py", *FAST, "--out", runs)
    check(res, "store_full")
    assert flat("No space left on device") in flat(res.err)
    assert digest(runs) == before and len(runs_intact(runs)) == 1  # no half-written run left


@pytest.mark.parametrize("name, damage", [
    ("summary_corrupt", lambda s: '{"script": "train.py", "status": '),
    ("summary_wrong_types", lambda s: json.dumps(s | {"device": "cpu", "step_time_ms": 5, "steps_recorded": "5"})),
])
def test_summary_faults(runs, name, damage):
    (good,) = store.list_runs(runs)
    bad = runs / "20991231-000000-bad"
    shutil.copytree(good, bad)
    (bad / store.SUMMARY).write_text(damage(json.loads((good / store.SUMMARY).read_text())))
    for args in (["report"], ["suggest", bad.name], ["report", bad.name]):
        res = kprof(*args, "--out", runs)
        check(res, name)
        assert flat(str(bad / store.SUMMARY)) in flat(res.err)
    # `kprof runs` lists the good run and marks the bad one
    res = kprof("runs", "--out", runs)
    assert res.code == 0 and good.name in res.out and "unreadable" in res.out
    assert all(len(line) <= 80 for line in res.out.splitlines())
    # the default run of suggest and apply skips it
    res = kprof("suggest", "--out", runs)
    assert res.code == 0 and good.name in flat(res.out)


def test_trace_truncated(tmp_path, monkeypatch):
    from torch.profiler import profile as torch_profile

    real = torch_profile.export_chrome_trace

    def truncated(self, path):
        real(self, path)
        with open(path, "r+b") as f:
            f.truncate(max(1, f.seek(0, 2) // 2))

    monkeypatch.setattr(torch_profile, "export_chrome_trace", truncated)
    s = script(tmp_path, "")
    before = digest(s)
    res = kprof("profile", s, *FAST, "--out", tmp_path / "runs")
    check(res, "trace_truncated")
    (run,) = runs_intact(tmp_path / "runs")  # the measurements are kept, the error in the run
    assert "truncated" in store.load_summary(run)["analysis_error"] and digest(s) == before


def _save(root, barrier, name):
    barrier.wait()
    summary = {"script": "train.py", "status": "completed"}
    run = store.save_run(summary, pd.DataFrame({"op": ["aten::mm"], "x": [1.0]}), None, root=root, name=name)
    from kprof.plan.suggest import save_plan

    save_plan(store.load_run(run), pd.DataFrame())


def test_two_writers(tmp_path):
    # Two processes save a run under the same name at the same moment, then plan.json in it.
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_save, args=(tmp_path / "runs", barrier, "20260101-000000-train")) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    runs = runs_intact(tmp_path / "runs")
    assert sorted(r.name for r in runs) == ["20260101-000000-train", "20260101-000000-train-2"]
    assert all(json.loads((r / "plan.json").read_text())["run"] == r.name for r in runs)
    res = kprof("runs", "--out", tmp_path / "runs")
    check(res, "two_writers")

"""The run store: round trip, atomic naming under concurrency, and clear errors for broken runs."""

from __future__ import annotations

import gzip
import json
import pathlib
import re
import threading

import pandas as pd
import pytest

from kprof import store
from kprof.errors import KprofError


def _ops() -> pd.DataFrame:
    return pd.DataFrame({
        "step": [0, 0, 1],
        "module": ["transformer.h.0.attn", "", "<optimizer>"],
        "op": ["aten::mm", "aten::add", "aten::_fused_adamw_"],
        "input_shapes": [[[8, 128], [128, 384]], [[8, 128], [8, 128]], [[]]],
        # mixed item types: Arrow can't type this column, so it is stored as JSON text
        "concrete_inputs": [["", ""], ["", 1], [None, 0.5, "x"]],
        "device_time (us)": [12.5, 3.0, float("nan")],
        "cost_known": [True, True, False],
    })


def _summary(script="examples/gpt_train.py", **kw) -> dict:
    return {"script": script, "argv": [], "status": "stopped", "step_time_ms": {"median": 1.5}} | kw


def test_round_trip_keeps_types_and_lists(tmp_path):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [{"name": "x", "ph": "X", "ts": 1, "dur": 2}]}))
    ops = _ops()
    path = store.save_run(_summary(nan=float("nan")), ops, trace, root=tmp_path / "runs")

    assert path.parent == tmp_path / "runs"
    assert path.name.endswith("-gpt_train") and len(path.name.split("-")[0]) == 8  # YYYYmmdd-HHMMSS-stem
    assert sorted(p.name for p in path.iterdir()) == ["ops.parquet", "summary.json", "trace.json.gz"]

    summary = store.load_summary(path)
    assert summary["script"] == "examples/gpt_train.py"
    assert summary["nan"] is None  # NaN is not JSON; stored as null
    assert summary["files"] == {"summary": "summary.json", "ops": "ops.parquet", "trace": "trace.json.gz"}
    assert summary["format"] == store.FORMAT

    back = store.load_ops(path)
    assert list(back.columns) == list(ops.columns)
    assert back["input_shapes"].tolist() == ops["input_shapes"].tolist()
    assert back["concrete_inputs"].tolist() == ops["concrete_inputs"].tolist()
    assert back["device_time (us)"].iloc[:2].tolist() == [12.5, 3.0] and pd.isna(back["device_time (us)"].iloc[2])
    assert back["cost_known"].dtype == bool

    with gzip.open(path / "trace.json.gz") as f:
        assert json.load(f)["traceEvents"][0]["name"] == "x"

    run = store.load_run(None, tmp_path / "runs")
    assert run.path == path and run.trace_path == path / "trace.json.gz" and len(run.ops) == 3


def test_run_without_trace(tmp_path):
    path = store.save_run(_summary(), _ops(), None, root=tmp_path)
    assert not (path / "trace.json.gz").exists()
    assert store.load_summary(path)["files"]["trace"] is None
    assert store.load_run(path).trace_path is None


def test_concurrent_saves_never_clobber(tmp_path):
    """Eight saves race for the same name; each lands in its own directory, intact."""
    n = 8
    barrier = threading.Barrier(n)
    paths, errors = [None] * n, []

    def save(i):
        try:
            barrier.wait()
            paths[i] = store.save_run(_summary(who=i), _ops(), None, root=tmp_path, name="20250101-000000-x")
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(p.name for p in paths) == sorted(["20250101-000000-x"] + [f"20250101-000000-x-{i}" for i in range(2, n + 1)])
    assert sorted(store.load_summary(p)["who"] for p in paths) == list(range(n))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def _save_in_child(root, i, barrier, q):
    barrier.wait()
    q.put(str(store.save_run(_summary(who=i), _ops(), None, root=root, name="20250101-000000-p")))


def test_concurrent_saves_from_processes(tmp_path):
    """Two kprof processes saving at once (the real case: two `kprof profile` in one second)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the children only need the store; fork starts them in ms
    barrier, q = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_save_in_child, args=(tmp_path, i, barrier, q)) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    paths = sorted(q.get(timeout=5) for _ in procs)
    assert [store.load_summary(p)["who"] for p in paths] in ([0, 1], [1, 0])
    assert [pathlib.Path(p).name for p in paths] == ["20250101-000000-p", "20250101-000000-p-2"]


def test_list_and_latest(tmp_path):
    assert store.list_runs(tmp_path / "none") == []
    with pytest.raises(KprofError, match="no runs in"):
        store.latest_run(tmp_path)
    a = store.save_run(_summary(), _ops(), None, root=tmp_path, name="20250101-000000-a")
    b = store.save_run(_summary(), _ops(), None, root=tmp_path, name="20250102-000000-b")
    (tmp_path / ".tmp-unfinished").mkdir()  # an interrupted save is not a run
    assert store.list_runs(tmp_path) == [a, b]
    assert store.latest_run(tmp_path) == b
    assert store.resolve_run("20250101-000000-a", tmp_path) == a
    assert store.resolve_run(str(a), tmp_path / "elsewhere") == a
    assert store.resolve_run(a / "summary.json", tmp_path) == a


def test_missing_and_corrupt_runs_name_the_file(tmp_path):
    with pytest.raises(KprofError, match="nope not found"):
        store.resolve_run("nope", tmp_path)
    with pytest.raises(KprofError, match="not found"):
        store.load_summary(tmp_path / "nope")

    run = store.save_run(_summary(), _ops(), None, root=tmp_path)
    summary = run / "summary.json"

    summary.write_text("{not json")
    with pytest.raises(KprofError, match=f"{re.escape(str(summary))}.*corrupt"):
        store.load_summary(run)
    summary.write_text("[1, 2]")
    with pytest.raises(KprofError, match=f"{re.escape(str(summary))} is not a kprof run summary"):
        store.load_summary(run)
    summary.write_text(json.dumps({"script": "x.py", "format": store.FORMAT + 1}))
    with pytest.raises(KprofError, match="newer kprof"):
        store.load_summary(run)
    summary.unlink()
    with pytest.raises(KprofError, match=f"{re.escape(str(summary))} is missing"):
        store.load_summary(run)

    ops = run / "ops.parquet"
    ops.write_bytes(b"PAR1 garbage")
    with pytest.raises(KprofError, match=f"{re.escape(str(ops))}.*corrupt"):
        store.load_ops(run)
    ops.unlink()
    with pytest.raises(KprofError, match=f"{re.escape(str(ops))} is missing"):
        store.load_ops(run)


def test_unwritable_store_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KprofError, match="cannot create the run store"):
        store.save_run(_summary(), _ops(), None, root=blocker / "runs")

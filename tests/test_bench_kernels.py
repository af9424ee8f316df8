"""benchmarks/bench_kernels.py's CPU parts: the CSV's append-only columns and the summary table
(the timings themselves need the GPU and are not tested here)."""

import csv

import pandas as pd
import pytest

from benchmarks import bench_kernels as bk

OLD_FIELDS = bk.CSV_FIELDS[: bk.CSV_FIELDS.index("note") + 1]  # the header before graphn_us


def _row(impl, mode, **kw):
    base = {"date": "2026-11-30T09:00Z", "gpu": "NVIDIA H200", "kernel": "rms_norm", "case": "RMSNorm 16384x4096",
            "impl": impl, "mode": mode, "floor_us": 63.2, "target_us": "", "meets_target": ""}
    return {**base, **kw}


def test_old_csv_gets_the_new_header_and_keeps_its_rows(tmp_path):
    path = tmp_path / "kernels.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=OLD_FIELDS)
        w.writeheader()
        w.writerow({k: v for k, v in _row("kprof", "fwd", median_us=132.6, graph_us=72.6).items() if k in OLD_FIELDS})
    bk._flush([_row("kprof", "fwd", median_us=130.0, graph_us=72.0, graphn_us=67.9, graph_calls=30,
                    basis="graphn_us")], path)
    df = pd.read_csv(path)
    assert list(df.columns) == bk.CSV_FIELDS
    assert df["median_us"].tolist() == [132.6, 130.0]
    assert pd.isna(df["graphn_us"][0]) and df["graphn_us"][1] == 67.9
    assert df["basis"].tolist()[1] == "graphn_us"


def test_a_csv_with_other_columns_is_refused(tmp_path):
    path = tmp_path / "kernels.csv"
    path.write_text("date,gpu,something_else\n1,2,3\n")
    with pytest.raises(SystemExit, match="not a prefix"):
        bk._flush([_row("kprof", "fwd")], path)
    assert path.read_text() == "date,gpu,something_else\n1,2,3\n"  # nothing lost


def test_graph_calls_bounds():
    assert bk.graph_calls(70.0) == 29  # ~2 ms of work per replay
    assert bk.graph_calls(0.5) == 32
    assert bk.graph_calls(40000.0) == 2  # both input sets, even for a 40 ms step


def test_summary_table_prints_graphn_per_impl(tmp_path, capsys):
    path = tmp_path / "kernels.csv"
    rows = [_row("kprof", "fwd", median_us=130.0, graph_us=72.0, graphn_us=67.9, pct_copy_bw=93.1),
            _row("liger", "fwd", median_us=137.0, graph_us=71.9, graphn_us=68.4)]
    bk._flush(rows, path)
    bk._print_table(path, "2026-11-30T09:00Z")
    out = capsys.readouterr().out
    assert "graphn_us" in out and "67.9" in out and "68.4" in out and "kprof 1/replay" in out

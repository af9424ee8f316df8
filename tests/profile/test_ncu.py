"""kprof's class vs Nsight Compute's counters (kprof.analyze.ncu, kprof.capture.ncu, `profile --ncu`,
`report --kernels`): the reference rule and the agreement on planted counter values, the CSV
parser on tests/data/ncu_details_sample.csv, and the commands without and with a (stubbed) ncu.

ncu_details_sample.csv was written by hand in ncu's `--csv --page details` format (the header
and "Command line profiler metrics" rows ncu prints for `--metrics`, the metric names of
kprof.analyze.ncu.METRICS, thousands separators in values): no GPU was available to record
one. Its numbers are planted, not measured.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gpu_kernel_trace
import pandas as pd
import pytest
from rich.console import Console

from kprof import cli, store
from kprof.analyze import ceilings, costmodel, efficiency, kernels, ncu, tables, trace
from kprof.capture import ncu as capture
from kprof.errors import KprofError
from kprof.store import Run

DATA = Path(__file__).parents[1] / "data"
SAMPLE = DATA / "ncu_details_sample.csv"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas"
ADD4 = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char *, 3>>(int, T2, T3)"


def test_parse_sample_csv():
    launches = ncu.parse_csv(SAMPLE.read_text())
    assert list(launches["ID"]) == [0, 1, 2, 3]
    g = launches.iloc[0]
    assert g["kernel"] == GEMM and g["grid"] == "(132, 1, 1)" and g["block"] == "(384, 1, 1)"
    assert g["duration (ns)"] == 1_402_336.0  # "1,402,336" nsecond
    assert (g["DRAM %"], g["SM %"], g["occupancy %"]) == (18.41, 72.80, 18.62)
    assert g["tensor %"] == 71.37  # the larger of HMMA (0) and GMMA (71.37): wgmma on sm_90
    # A demangled name with commas and parentheses survives the CSV quoting.
    assert launches.iloc[2]["kernel"] == ADD4
    per = ncu.per_kernel(launches).set_index("kernel")
    assert per.loc[ADD4, "launches"] == 2
    w = (40_096 * 84.66 + 39_904 * 82.10) / (40_096 + 39_904)
    assert per.loc[ADD4, "DRAM %"] == pytest.approx(w)


def test_parse_units_and_errors():
    text = SAMPLE.read_text().replace('"nsecond","1,402,336"', '"usecond","1,402.336"')
    assert ncu.parse_csv(text).iloc[0]["duration (ns)"] == pytest.approx(1_402_336.0)
    with pytest.raises(KprofError, match="no Nsight Compute table"):
        ncu.parse_csv("==ERROR== ERR_NVGPUCTRPERM - no permission to access NVIDIA GPU Performance Counters")


@pytest.mark.parametrize("dram,tensor,fma,alu,expected", [
    (84.7, 0.0, 6.0, 9.8, "memory-bound"),  # a streaming elementwise kernel
    (18.4, 71.4, 4.1, 3.1, "compute-bound"),  # a GEMM on the tensor pipe
    (31.2, 0.0, 14.9, 22.5, "neither"),  # strided elementwise: SM throughput 62% is load/store, not compute
    (10.0, 0.5, 60.0, 20.0, "compute-bound"),  # tensor pipe under 1% active: a non-tensor kernel, FMA counts
    (35.0, 34.0, 0.0, 0.0, "neither"),  # flash attention as the issue measured it: nothing near a limit
    (55.0, 60.0, 0.0, 0.0, "compute-bound"),
    (60.0, 55.0, 0.0, 0.0, "memory-bound"),
    (50.0, 50.0, 0.0, 0.0, "neither"),  # a tie is neither above the other
    (math.nan, math.nan, math.nan, math.nan, "neither"),
])
def test_reference_class(dram, tensor, fma, alu, expected):
    assert ncu.reference_class(dram, tensor, fma, alu) == expected


def test_compare_and_agreement_planted():
    by_name = pd.DataFrame({
        "kernel": [GEMM, "void at::native::elementwise_kernel<128, 2>(int, T3)", ADD4, "flash_fwd", "ncclKernel",
                   "tiny"],
        "time/step (us)": [1400.0, 150.0, 80.0, 300.0, 50.0, 2.0],
        "class": ["compute-bound", "memory-bound", "memory-bound", "compute-bound", "communication",
                  "latency-bound"],
        efficiency.QUALIFIER: [False, True, False, False, False, False],
    })
    counters = pd.DataFrame({
        "kernel": [GEMM, "void at::native::elementwise_kernel<128, 2, void other<...>>(int, T3)", ADD4, "flash_fwd",
                   "ncclKernel"],
        "launches": [1, 1, 2, 1, 1], "duration (ns)": [1.4e6, 1.5e5, 8e4, 3e5, 5e4],
        "DRAM %": [18.4, 31.2, 83.4, 35.0, 5.0], "SM %": [72.8, 61.8, 21.2, 40.0, 5.0],
        "tensor %": [71.4, 0.0, 0.0, 34.0, 0.0], "FMA %": [4.0, 14.9, 6.0, 1.0, 0.0],
        "ALU %": [3.1, 22.5, 9.8, 2.0, 0.0], "occupancy %": [18.6, 88.1, 80.3, 12.0, 3.0],
    })
    t = ncu.compare(by_name, counters).set_index("kernel")
    # The under-used elementwise kernel is expected to reach neither bound, and ncu agrees; its
    # name differs in template arguments only, matched by the base name.
    ew = t.loc["void at::native::elementwise_kernel<128, 2>(int, T3)"]
    assert (ew["expects"], ew["ncu class"], ew["agree"]) == ("neither", "neither", True)
    assert t.loc[GEMM, "agree"] and t.loc[ADD4, "agree"]
    assert (t.loc["flash_fwd", "ncu class"], t.loc["flash_fwd", "agree"]) == ("neither", False)
    assert t.loc["ncclKernel", "agree"] is None  # communication: not scored
    assert t.loc["tiny", "agree"] is None and t.loc["tiny", "ncu class"] == ""  # not measured
    a = ncu.agreement(ncu.compare(by_name, counters))
    assert (a["scored"], a["agree"], a["not scored"]) == (4, 3, 2)
    assert a["by count (%)"] == 75.0
    assert a["by time (%)"] == pytest.approx(100 * (1400 + 150 + 80) / (1400 + 150 + 80 + 300))


def test_select_estimate_and_metrics():
    by_name = pd.DataFrame({"kernel": list("abc"), "time/step (us)": [30.0, 20.0, 10.0],
                            "launches/step": [8.0, 16.0, 1.0]})
    sel = ncu.select(by_name, 2)
    assert list(sel["kernel"]) == ["a", "b"]
    assert ncu.estimate_seconds(sel) == pytest.approx(24 * ncu.SECONDS_PER_LAUNCH)
    assert ncu.METRICS["tensor GMMA %"] in ncu.metrics_for("9.0")
    assert ncu.METRICS["tensor GMMA %"] not in ncu.metrics_for("8.0")
    assert ncu.base_name(ADD4) == "vectorized_elementwise_kernel"


def test_ncu_command_line():
    names = [ADD4, "k(int)"]
    cmd = capture.profile_command("/usr/bin/ncu", "/tmp/r", "train.py", ["--lr", "1"], names,
                                  ncu.metrics_for("9.0"), warmup=3)
    assert cmd[cmd.index("--nvtx-include") + 1] == "kprof.ncu/"  # push/pop ranges end in "/"
    assert cmd[cmd.index("--nvtx-push-pop-scope") + 1] == "process"  # backward runs on autograd's thread
    rx = cmd[cmd.index("--kernel-name") + 1]
    assert rx.startswith("regex:^(") and "k\\(int\\)" in rx
    assert cmd[-3:] == ["--", "--lr", "1"] and cmd[cmd.index("--warmup") + 1] == "3"
    assert re.fullmatch(capture.kernel_regex(names), ADD4)
    assert not re.fullmatch(capture.kernel_regex(names), "k(int)x")


# ----------------------------------------------------------------------------------------------
# The commands, on a run analysed from gpu_kernel_trace.py


@pytest.fixture
def gpu_run(tmp_path):
    ev = trace.load_trace(gpu_kernel_trace.write(tmp_path / "t.json.gz"))
    c = ceilings.datasheet_for("NVIDIA H200")
    ops = tables.roofline(costmodel.annotate(trace.op_table(ev)), c)
    ktab = kernels.kernel_table(ev, ops, c, gpu_kernel_trace.SMS)
    summary = {"script": str(tmp_path / "train.py"), "argv": [], "status": "stopped", "steps_recorded": 1,
               "device": {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0", "sm_count": 132},
               "top_kernels": kernels.top_kernels(ktab, 1, 20, 1000.0).to_dict(orient="records"),
               "under_used_threshold": {"value": efficiency.UNDER_USED_THRESHOLD, "fitted": False}}
    path = store.save_run(summary, ops, None, root=tmp_path / "runs", kernels=ktab)
    return Run(path=path, summary=store.load_summary(path))


def _cli(capsys, monkeypatch, width, *args):
    monkeypatch.setattr(cli, "console", Console(width=width, force_terminal=False, color_system=None))
    monkeypatch.setattr(cli, "err_console", Console(width=width, stderr=True, color_system=None))
    with pytest.raises(SystemExit) as e:
        cli.main(list(map(str, args)))
    out, err = capsys.readouterr()
    return e.value.code or 0, out, err


def _fake_profile(monkeypatch, run):
    monkeypatch.setattr("kprof.analyze.profile.profile_script", lambda *a, **k: run)
    monkeypatch.setattr("kprof.cli.render.render", lambda *a, **k: None)  # the per-op report has its own tests


def test_profile_ncu_without_ncu(capsys, monkeypatch, gpu_run, tmp_path):
    _fake_profile(monkeypatch, gpu_run)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no ncu anywhere
    code, _, err = _cli(capsys, monkeypatch, 200, "profile", tmp_path / "train.py", "--ncu")
    assert code == 0
    assert capture.HINT in " ".join(err.split())
    assert not (gpu_run.path / store.NCU).exists()


def test_profile_ncu_with_stubbed_ncu(capsys, monkeypatch, gpu_run, tmp_path):
    """ncu itself replaced by a function that writes ncu's CSV for the kernels it was asked for."""
    _fake_profile(monkeypatch, gpu_run)
    monkeypatch.setattr(cli, "_find_ncu", lambda: "/opt/nvidia/ncu")
    header = next(ln for ln in SAMPLE.read_text().splitlines() if ln.startswith('"ID"'))
    planted = {"sm90_xmma_gemm_bf16bf16_bf16f32": (20.0, 70.0, 2.0), "elementwise_kernel_add": (30.0, 0.0, 20.0),
               "triton_poi_fused_gelu_0": (80.0, 0.0, 10.0), "splitKreduce_kernel": (60.0, 0.0, 5.0),
               "vectorized_elementwise_kernel_mul": (3.0, 0.0, 1.0)}
    asked = {}

    def fake_run(ncu_path, script, argv, names, metrics, warmup, workdir, timeout_s=None):
        asked.update(names=names, metrics=metrics)
        lines = [header]
        for i, n in enumerate(names):
            dram, tensor, fma = planted[n]
            for m, v, u in ((ncu.METRICS["duration (ns)"], "1,000", "nsecond"), (ncu.METRICS["DRAM %"], dram, "%"),
                            (ncu.METRICS["tensor GMMA %"], tensor, "%"), (ncu.METRICS["FMA %"], fma, "%")):
                lines.append(",".join(f'"{x}"' for x in (i, 1, "python", "h", n, 1, 7, "(128, 1, 1)", "(1, 1, 1)", 0,
                                                           "9.0", "Command line profiler metrics", m, u, v)))
        return "\n".join(lines)

    monkeypatch.setattr(capture, "run", fake_run)
    code, out, err = _cli(capsys, monkeypatch, 80, "profile", tmp_path / "train.py", "--ncu", "--ncu-top", "5")
    assert code == 0, err
    assert "measuring the top 5 kernels, 5 launches in one step, about 2 s" in " ".join(err.split())
    assert len(asked["names"]) == 5 and "Memcpy HtoD (Pinned -> Device)" not in asked["names"]
    doc = store.read_json(gpu_run.path, store.NCU)
    rows = {r["kernel"]: r for r in doc["kernels"]}
    assert rows["elementwise_kernel_add"]["agree"] is True  # under-used, and ncu sees no bound reached
    assert rows["triton_poi_fused_gelu_0"]["agree"] is None  # unknown cost: not scored
    assert doc["threshold_fitted"] is False
    assert "kprof's class vs Nsight Compute" in out and "agreement:" in out
    assert max(len(ln) for ln in out.splitlines()) <= 80
    # report --kernels shows the same again, and --json carries it
    code, out, _ = _cli(capsys, monkeypatch, 80, "report", gpu_run.path, "--kernels")
    assert code == 0 and "agreement:" in out and "under-used" in out
    assert max(len(ln) for ln in out.splitlines()) <= 80
    code, out, _ = _cli(capsys, monkeypatch, 80, "report", gpu_run.path, "--kernels", "--json")
    d = json.loads(out)
    assert d["ncu"]["agreement"]["scored"] == doc["agreement"]["scored"]
    assert len(d["summary"]["top_kernels"]) == 6


def test_report_kernels_at_80_columns(capsys, monkeypatch, gpu_run):
    code, out, _ = _cli(capsys, monkeypatch, 80, "report", gpu_run.path, "--kernels")
    assert code == 0
    assert max(len(ln) for ln in out.splitlines()) <= 80
    flat = " ".join(re.sub("[│┃]", " ", out).split())  # wrapped cells read on across the lines
    assert "splitKreduce_kernel" in flat  # a secondary kernel with a row of its own
    assert "memory-bound, under-used (strided)" in flat
    assert "memory-bound, under-used (unaligned, small grid)" in flat
    assert "threshold not yet fitted" in flat


def test_report_kernels_cpu_run(capsys, monkeypatch, tmp_path):
    path = store.save_run({"script": "t.py", "device": {"type": "cpu"}, "top_kernels": None},
                          pd.DataFrame({"op": ["aten::mm"]}), None, root=tmp_path)
    code, out, _ = _cli(capsys, monkeypatch, 80, "report", path, "--kernels")
    assert code == 0 and "CPU run: no device kernels" in " ".join(out.split())


def test_agreement_benchmark_rescores_a_threshold(gpu_run):
    """benchmarks/ncu_agreement.py's fit step (not run on the H200 yet) on planted counters: a
    threshold low enough calls nothing under-used, and the strided add then disagrees."""
    from benchmarks import ncu_agreement

    counters = pd.DataFrame({"kernel": ["elementwise_kernel_add", "sm90_xmma_gemm_bf16bf16_bf16f32"],
                             "launches": [1, 1], "duration (ns)": [1.5e5, 2e5], "DRAM %": [30.0, 20.0],
                             "SM %": [60.0, 70.0], "tensor %": [0.0, 70.0], "FMA %": [20.0, 2.0],
                             "ALU %": [20.0, 2.0], "occupancy %": [80.0, 20.0]})
    t_hi, a_hi = ncu_agreement.requalify(gpu_run, counters, 20, 0.5)
    t_lo, a_lo = ncu_agreement.requalify(gpu_run, counters, 20, 0.1)
    add = "elementwise_kernel_add"
    assert t_hi.set_index("kernel").loc[add, "agree"] and not t_lo.set_index("kernel").loc[add, "agree"]
    assert (a_hi["agree"], a_lo["agree"]) == (2, 1)
    md = ncu_agreement.markdown("synthetic", "fit", t_hi, a_hi, 0.5)
    assert md[0] == "## synthetic (fit, threshold 0.50)" and any("memory-bound, under-used" in ln for ln in md)

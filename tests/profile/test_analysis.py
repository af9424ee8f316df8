"""kprof.analyze.tables: roofline numbers and classes against given ceilings, idle time, breakdowns."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kprof.analyze import costmodel, trace
from kprof.analyze import tables as analysis
from kprof.analyze.ceilings import Ceilings

DATA = Path(__file__).parents[1] / "data"

# Round numbers so every expected value below is checkable by hand: 1000 GB/s, 100 TFLOP/s bf16
# (ridge 100 FLOP/B), 10 TFLOP/s fp32 (ridge 10 FLOP/B), 5 us latency threshold.
CEIL = Ceilings(device="test GPU", mem_bw_gbs=1000.0,
                peak_tflops={"fp32": 10.0, "tf32": 50.0, "bf16": 100.0, "fp16": 100.0},
                latency_us=5.0, source="test", kind="datasheet")


def row(op, flops, bytes_, time_us, dtype="bfloat16", n_kernels=1, known=True, kernel="k", module="m"):
    return dict(step=0, module=module, op=op, shapes="s", dtype=dtype, input_dtypes=[dtype],
                flops=flops if known else np.nan, bytes=bytes_ if known else np.nan, cost_known=known,
                tensor_core=costmodel._base(op) in costmodel.TENSOR_CORE_OPS, n_kernels=n_kernels,
                kernel=kernel, **{"device_time (us)": time_us})


def test_roofline_classes_and_numbers():
    n = 4096
    mm_flops, mm_bytes = 2 * n**3, 3 * n * n * 2  # bf16 4096^3 matmul: 137 GFLOP, 100.7 MB
    add_elems = 1 << 24
    ops = pd.DataFrame([
        row("aten::mm", mm_flops, mm_bytes, 2000.0),  # intensity 1365 FLOP/B > 100: compute-bound
        row("aten::add", add_elems, 3 * add_elems * 2, 200.0),  # 0.17 FLOP/B: memory-bound
        row("aten::mul", 1024, 3 * 1024 * 2, 3.0),  # 3 us per launch < 5 us: latency-bound
        row("aten::index", 0, 0, 50.0, known=False),  # no formula: unknown
        row("c10d::allreduce_", 0, 1e6, 80.0, kernel="ncclDevKernel_AllReduce"),  # communication
        row("aten::mm", 2 * 64 * 64 * 64, 3 * 64 * 64 * 2, 20.0, n_kernels=8),  # 2.5 us per launch: latency
    ])
    r = analysis.roofline(ops, CEIL)
    assert list(r["class"]) == ["compute-bound", "memory-bound", "latency-bound", "unknown", "communication",
                                "latency-bound"]
    mm = r.iloc[0]
    assert mm["dtype class"] == "bf16"
    assert mm["intensity (FLOP/B)"] == pytest.approx(mm_flops / mm_bytes)
    assert mm["attainable (us)"] == pytest.approx(mm_flops / 100e12 * 1e6)  # compute roof: 1374.4 us
    assert mm["TFLOP/s"] == pytest.approx(mm_flops / 2000e-6 / 1e12)
    assert mm["% of roofline"] == pytest.approx(100 * mm_flops / 100e12 * 1e6 / 2000.0)
    add = r.iloc[1]
    assert add["dtype class"] == "fp32"  # elementwise: CUDA-core fp32 peak
    assert add["attainable (us)"] == pytest.approx(3 * add_elems * 2 / 1000e9 * 1e6)  # memory roof
    assert add["GB/s"] == pytest.approx(3 * add_elems * 2 / 200e-6 / 1e9)
    assert math.isnan(r.iloc[3]["attainable (us)"]) and math.isnan(r.iloc[3]["% of roofline"])


def test_broadcast_tensors_is_not_communication():
    # aten::broadcast_tensors moves nothing between devices; a c10d broadcast does (issue 22)
    ops = pd.DataFrame([row("aten::broadcast_tensors", 0, 0, 10.0),
                        row("c10d::broadcast_", 0, 1e6, 80.0, kernel="ncclDevKernel_Broadcast")])
    assert list(analysis.roofline(ops, CEIL)["class"]) == ["latency-bound", "communication"]


def test_ridge_point_depends_on_dtype_class_and_tf32():
    # fp32 matmul at 50 FLOP/B: above the fp32 ridge (10) but below the tf32 ridge (50.x)
    ops = pd.DataFrame([row("aten::mm", 50e9, 1e9 - 1e6, 10_000.0, dtype="float32")])
    assert analysis.roofline(ops, CEIL)["class"].iloc[0] == "compute-bound"
    r = analysis.roofline(ops, CEIL, tf32=True)
    assert r["dtype class"].iloc[0] == "tf32" and r["class"].iloc[0] == "compute-bound"
    ops2 = pd.DataFrame([row("aten::mm", 40e9, 1e9, 10_000.0, dtype="float32")])
    assert analysis.roofline(ops2, CEIL, tf32=True)["class"].iloc[0] == "memory-bound"
    assert analysis.roofline(ops2, CEIL, tf32=False)["class"].iloc[0] == "compute-bound"


def test_zero_work_ops_are_latency_bound():
    ops = pd.DataFrame([row("aten::view", 0, 0, 50.0, n_kernels=0)])
    assert analysis.roofline(ops, CEIL)["class"].iloc[0] == "latency-bound"


def test_idle_by_step_union_of_streams():
    windows = pd.DataFrame({"step": [0, 1], "device start (us)": [0.0, 100.0], "device end (us)": [100.0, 200.0]})
    kernels = pd.DataFrame({
        "step": [0, 0, 0, 0, 1],
        "ts (us)": [0.0, 10.0, 50.0, 95.0, 150.0],
        "dur (us)": [20.0, 20.0, 10.0, 10.0, 20.0],  # [0,20] and [10,30] overlap (two streams); [95,105] clipped
    })
    idle = analysis.idle_by_step(kernels, windows).set_index("step")
    assert idle.loc[0, "busy (us)"] == 30 + 10 + 5
    assert idle.loc[0, "idle (us)"] == 100 - 45
    assert idle.loc[1, "idle (us)"] == 80 and idle.loc[1, "idle (%)"] == 80.0


def test_class_breakdown_has_idle_row():
    ops = analysis.roofline(pd.DataFrame([
        row("aten::mm", 2 * 4096**3, 3 * 4096 * 4096 * 2, 60.0),
        row("aten::add", 1 << 20, 6 << 20, 30.0),
    ]).assign(step=[0, 1]), CEIL)
    idle = pd.DataFrame({"step": [0, 1], "window (us)": [100.0, 100.0], "busy (us)": [60.0, 30.0],
                         "idle (us)": [40.0, 70.0], "idle (%)": [40.0, 70.0]})
    cb = analysis.class_breakdown(ops, idle, 2).set_index("class")
    assert cb.loc["idle", "time/step (ms)"] == pytest.approx(0.055)
    assert cb.loc["compute-bound", "time/step (ms)"] == pytest.approx(0.030)
    assert cb.loc["memory-bound", "% of step"] == pytest.approx(15.0)
    assert cb["% of step"].sum() == pytest.approx(100.0)  # no overlapping streams here


def test_top_ops_groups_and_per_step():
    ops = analysis.roofline(pd.DataFrame([
        row("aten::add", 1 << 20, 6 << 20, 30.0, module="a"),
        row("aten::add", 1 << 20, 6 << 20, 10.0, module="a"),
        row("aten::add", 1 << 20, 6 << 20, 25.0, module="b"),
    ]).assign(step=[0, 1, 0]), CEIL)
    top = analysis.top_ops(ops, n_steps=2, k=5, ceilings=CEIL)
    assert list(top["module"]) == ["a", "b"]
    a = top.iloc[0]
    assert a["time/step (ms)"] == pytest.approx(0.020) and a["calls/step"] == 1.0
    assert a["% of step"] == pytest.approx(100 * 20 / 32.5)
    assert a["GB/s"] == pytest.approx(2 * (6 << 20) / 40e-6 / 1e9)
    assert a["class"] == "memory-bound"
    assert analysis.top_ops(ops, 2, k=1)["module"].tolist() == ["a"]


def test_module_breakdown_depth():
    ops = pd.DataFrame([
        dict(module="model.layers.0.mlp", phase="fwd", flops=1e9, bytes=1e6, **{"device_time (us)": 100.0}),
        dict(module="model.layers.0.attn", phase="bwd", flops=2e9, bytes=1e6, **{"device_time (us)": 300.0}),
        dict(module="<optimizer>", phase="optim", flops=0.0, bytes=1e6, **{"device_time (us)": 100.0}),
    ])
    m = analysis.module_breakdown(ops, 1, depth=3).set_index("module")
    assert m.loc["model.layers.0", "time/step (ms)"] == pytest.approx(0.4)
    assert m.loc["model.layers.0", "fwd (ms/step)"] == pytest.approx(0.1)
    assert m.loc["model.layers.0", "% of op time"] == pytest.approx(80.0)
    assert m.loc["<optimizer>", "GFLOP/step"] == 0


def test_step_stats_and_overhead():
    s = analysis.step_stats([10.0, 11.0, 12.0, 13.0, 30.0])
    assert s["median"] == 12.0 and s["spread"] == pytest.approx(np.percentile([10, 11, 12, 13, 30], 90) - 10.4)
    assert s["spread_definition"] == "p90 - p10"
    assert analysis.step_stats([5.0])["spread"] == 0.0
    assert analysis.step_stats([])["median"] is None
    assert analysis.overhead([11.0, 11.0], [10.0, 10.0]) == pytest.approx(0.1)
    assert analysis.overhead([], [1.0]) is None


def test_pipeline_on_real_cpu_trace():
    """load -> op table -> costs -> roofline -> breakdowns on the checked-in tiny Llama trace."""
    ev = trace.load_trace(DATA / "llama_cpu.json.gz")
    ops = analysis.roofline(costmodel.annotate(trace.op_table(ev)), CEIL)
    assert set(ops["class"]) <= set(analysis.CLASSES)
    assert analysis.coverage(ops) >= 0.95
    idle = analysis.idle_by_step(trace.kernel_table(ev), trace.step_windows(ev))
    assert list(idle["step"]) == [0, 1] and (idle["idle (us)"] >= 0).all()
    cb = analysis.class_breakdown(ops, idle, 2)
    assert "idle" in set(cb["class"])
    # on one CPU thread nothing overlaps: the classes and idle fill the step exactly
    assert cb["% of step"].sum() == pytest.approx(100.0)
    top = analysis.top_ops(ops, 2, 10, ceilings=CEIL, idle=idle)
    assert len(top) == 10 and top["time/step (ms)"].is_monotonic_decreasing


def test_every_figure_is_on_the_unprofiled_step():
    """The H200 case of issue 20: 'profile' said GPU busy 16.5% of the profiled step where
    'suggest' said 44% of the unprofiled one. Busy 4 ms in a 10 ms profiled window, 5 ms
    unprofiled step: busy 80%, idle 1 ms, and % of step over 5 ms, in tables and modules alike."""
    from kprof.analyze.modules import busy_share, step_ms

    idle = pd.DataFrame({"step": [0, 1], "window (us)": [10000.0, 10000.0], "busy (us)": [4000.0, 4000.0],
                         "idle (us)": [6000.0, 6000.0], "idle (%)": [60.0, 60.0]})
    b = analysis.idle_basis(idle, plain_ms=5.0)
    assert b == {"step (us)": 5000.0, "busy (us)": 4000.0, "idle (us)": 1000.0, "busy %": 80.0,
                 "basis": "unprofiled step"}
    ops = pd.DataFrame([row("aten::mm", 1e9, 1e6, 3000.0), row("aten::add", 1e6, 1e6, 1000.0, dtype="float32")])
    ops = analysis.roofline(ops, CEIL)
    cb = analysis.class_breakdown(ops, idle, n_steps=1, plain_ms=5.0).set_index("class")
    assert cb.loc["compute-bound", "% of step"] == pytest.approx(60.0)  # 3 ms of 5
    assert cb.loc["idle", "time/step (ms)"] == pytest.approx(1.0)
    top = analysis.top_ops(ops, 1, idle=idle, plain_ms=5.0)
    assert top["% of step"].tolist() == pytest.approx([60.0, 20.0])
    # the summary's view (suggest, diagnoses, the host-bound caveat) gives the same numbers
    summary = {"device": {"type": "cuda"}, "idle_by_step": idle.to_dict("records"), "step_time_ms": {"median": 5.0}}
    assert busy_share(summary)["busy %"] == pytest.approx(80.0) and step_ms(summary) == pytest.approx(5.0)
    # no unprofiled steps: the profiled window, said so
    b = analysis.idle_basis(idle, plain_ms=None)
    assert b["step (us)"] == 10000.0 and b["busy %"] == 40.0 and b["basis"] == "profiled step"


@pytest.mark.parametrize("unprofiled, profiled, flagged", [
    ([10.0, 10.5, 9.8, 10.2, 10.1], [17.0, 16.5, 17.2, 16.9, 17.1], []),  # +70%: a profiler's usual cost
    ([10.0, 10.5, 9.8, 10.2, 10.1], [958.0, 950.0, 960.0, 955.0, 962.0], ["profiled steps took +9"]),
    ([10.0, 60.0, 9.0, 70.0, 11.0], [12.0, 70.0, 11.0, 80.0, 13.0], ["vary more than their median"]),
])
def test_nonsense_timings_are_flagged(unprofiled, profiled, flagged):
    got = analysis.timing_warnings(unprofiled, profiled)
    assert len(got) == len(flagged) and all(f in g for f, g in zip(flagged, got))
    assert all("profile again" in g for g in got)  # what to do about it

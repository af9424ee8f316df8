"""Every kernel its own row (kprof.analyze.kernels) and the under-used qualifier
(kprof.analyze.efficiency), on the hand-written Kineto-format GPU trace of gpu_kernel_trace.py
and on planted values."""

from __future__ import annotations

import math
from pathlib import Path

import gpu_kernel_trace
import numpy as np
import pandas as pd
import pytest

from kprof.analyze import ceilings, costmodel, efficiency, kernels, tables, trace

H200 = ceilings.datasheet_for("NVIDIA H200")


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    return trace.load_trace(gpu_kernel_trace.write(tmp_path_factory.mktemp("k") / "t.json.gz"))


@pytest.fixture(scope="module")
def ops(events):
    return tables.roofline(costmodel.annotate(trace.op_table(events)), H200)


@pytest.fixture(scope="module")
def ktab(events, ops):
    return kernels.kernel_table(events, ops, H200, gpu_kernel_trace.SMS)


def test_every_kernel_is_its_own_row(events, ops):
    k = trace.kernel_rows(events)
    assert len(k) == 6  # 5 kernels and the memcpy, where the op table has 5 rows
    assert len(ops) == 5
    mm = k[k["op"] == "aten::mm"]
    assert list(mm["kernel"]) == ["sm90_xmma_gemm_bf16bf16_bf16f32", "splitKreduce_kernel"]
    assert set(mm["module"]) == {"proj"} and set(mm["phase"]) == {"fwd"}
    assert list(mm["dur (us)"]) == [200.0, 20.0]
    # The split-K reduce is not the op's longest kernel: the op table never names it.
    assert "splitKreduce_kernel" not in set(ops["kernel"])
    # Kineto's launch arguments, per kernel; none on a memcpy.
    gemm = k.set_index("kernel").loc["sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert (gemm["grid"], gemm["block"], gemm["blocks"], gemm["registers"]) == ([132, 1, 1], [384, 1, 1], 132.0, 168.0)
    cp = k.set_index("kernel").loc["Memcpy HtoD (Pinned -> Device)"]
    assert cp["grid"] == [] and math.isnan(cp["blocks per SM"])
    # A kernel launched outside any op is its own op row; both tables name it by the same row_id.
    tri = k.set_index("kernel").loc["triton_poi_fused_gelu_0"]
    assert tri["row_id"] < 0 and tri["module"] == "act"
    assert tri["row_id"] in set(ops["row_id"])
    # Nothing lost, nothing counted twice.
    assert k["dur (us)"].sum() == ops["device_time (us)"].sum()
    for rid, t in k.groupby("row_id")["dur (us)"].sum().items():
        assert ops.set_index("row_id").loc[rid, "device_time (us)"] == t


def test_cost_split_by_time_share(ops, ktab):
    mm_op = ops.set_index("op").loc["aten::mm"]
    mm = ktab[ktab["op"] == "aten::mm"].set_index("kernel")
    np.testing.assert_allclose(mm["op time share"].to_numpy(), [200 / 220, 20 / 220])
    np.testing.assert_allclose(mm["flops"].sum(), mm_op["flops"])
    np.testing.assert_allclose(mm["bytes"].sum(), mm_op["bytes"])
    np.testing.assert_allclose(mm.loc["splitKreduce_kernel", "flops"], mm_op["flops"] * 20 / 220)
    # Same intensity, so the same class and % of roofline as the op.
    assert set(mm["class"]) == {mm_op["class"]} == {"compute-bound"}
    np.testing.assert_allclose(mm["% of roofline"].to_numpy(), mm_op["% of roofline"])


def test_under_used_kernels_and_causes(ktab):
    k = ktab.set_index("kernel")
    add = k.loc["elementwise_kernel_add"]
    assert add["class"] == "memory-bound" and add["% of roofline"] < 100 * efficiency.UNDER_USED_THRESHOLD
    assert add[efficiency.QUALIFIER] and add["causes"] == "strided"
    mul = k.loc["vectorized_elementwise_kernel_mul"]
    assert mul[efficiency.QUALIFIER] and mul["causes"] == "unaligned, small grid"
    gemm = k.loc["sm90_xmma_gemm_bf16bf16_bf16f32"]
    assert not gemm[efficiency.QUALIFIER] and gemm["causes"] == ""
    assert not k.loc["triton_poi_fused_gelu_0", efficiency.QUALIFIER]  # unknown cost: no bound to under-use


def test_ops_take_their_kernels_grid_causes(ops, ktab):
    q = efficiency.qualify(ops, gpu=True, sm_count=gpu_kernel_trace.SMS,
                           extra_causes=ops["row_id"].map(kernels.op_grid_causes(ktab)))
    assert q.set_index("op").loc["aten::mul", "causes"] == "unaligned, small grid"
    assert q.set_index("op").loc["aten::add", "causes"] == "strided"
    # A CPU run: nothing is under-used (a CPU's % of roofline is against a low default).
    assert not efficiency.qualify(ops, gpu=False)[efficiency.QUALIFIER].any()


def test_top_kernels(ktab):
    top = kernels.top_kernels(ktab, n_steps=1, k=3, step_us=1000.0)
    assert list(top["kernel"]) == ["sm90_xmma_gemm_bf16bf16_bf16f32", "elementwise_kernel_add",
                                   "triton_poi_fused_gelu_0"]
    row = top.set_index("kernel").loc["elementwise_kernel_add"]
    assert (row["op"], row["modules"], row["time/step (ms)"], row["% of step"]) == ("aten::add", "rope", 0.15, 15.0)
    assert row[efficiency.QUALIFIER] and row["causes"] == "strided"
    names = kernels.by_name(ktab, 1)
    assert "Memcpy HtoD (Pinned -> Device)" not in set(names["kernel"])  # ncu measures kernels only
    assert names.iloc[0]["kernel"] == "sm90_xmma_gemm_bf16bf16_bf16f32" and names.iloc[0]["tensor_core"]


@pytest.mark.parametrize("shape,strides,strided", [
    ([8, 2048, 32, 64], [4194304, 2048, 64, 1], False),
    ([8, 2048, 32, 64], [8388608, 4096, 128, 1], True),  # half of a [.., 128] tensor
    ([64, 32], [1, 64], True),  # a transpose
    ([1, 4096], [1, 1], False),  # size-1 dims do not count
    ([4096, 64], [0, 1], False),  # a broadcast row
    ([4096, 64], [], False),  # strides not recorded: not called strided
])
def test_is_strided(shape, strides, strided):
    assert efficiency.is_strided(shape, strides) is strided


@pytest.mark.parametrize("shape,dtype,unaligned", [
    ([64, 1001], "float32", True), ([64, 1000], "float32", False), ([8, 50257], "bfloat16", True),
    ([8, 4096], "bfloat16", False), ([8, 1], "float32", False), ([8, 3], "int64", False),
])
def test_is_unaligned(shape, dtype, unaligned):
    assert efficiency.is_unaligned(shape, dtype) is unaligned


def test_grid_causes():
    assert efficiency.grid_causes(64 / 132, math.nan) == ["small grid"]
    # 1.25 waves: the last wave fills a quarter of the GPU, 37.5% of the kernel's capacity idle.
    w = efficiency.waves(blocks=132 * 5, occupancy_pct=50, threads_per_block=256, sm_count=132)
    assert w == pytest.approx(5 / 4)  # 50% of 64 warps = 32 warps = 4 blocks of 8 warps per SM
    assert efficiency.grid_causes(5.0, w) == ["tail"]
    assert efficiency.grid_causes(8.0, 2.0) == []  # whole waves
    assert efficiency.grid_causes(80.0, 20.25) == []  # many waves: the tail is a small share
    assert math.isnan(efficiency.waves(100, math.nan, 256, 132))


def test_qualify_planted_threshold():
    """The qualifier is the class, a GPU run and the threshold; nothing else."""
    df = pd.DataFrame({"class": ["memory-bound", "memory-bound", "compute-bound", "latency-bound", "unknown"],
                       "% of roofline": [49.9, 50.0, 10.0, 5.0, np.nan]})
    q = efficiency.qualify(df, gpu=True, threshold=0.5)
    assert list(q[efficiency.QUALIFIER]) == [True, False, True, False, False]
    assert list(q["causes"]) == ["", "", "", "", ""]
    assert efficiency.label("memory-bound", True) == "memory-bound, under-used"



@pytest.mark.gpu
def test_gpu_real_trace_kernel_rows(tmp_path):
    """On a real GPU trace: Kineto records the launch arguments, and the kernel rows hold every
    kernel of the op table, each once, with its cost split."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("make_traces", Path(__file__).parents[1] / "data" / "make_traces.py")
    make_traces = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_traces)
    model = make_traces.MLP(256, 1024).cuda()
    x = torch.randn(512, 256, device="cuda")

    def step():
        model(x).square().mean().backward()

    ev = trace.load_trace(make_traces.record(model, step, 2, tmp_path / "gpu.json.gz", warmup=2))
    ops = tables.roofline(costmodel.annotate(trace.op_table(ev)), H200)
    k = kernels.kernel_table(ev, ops, H200, torch.cuda.get_device_properties(0).multi_processor_count)
    kk = k[k["cat"] == "kernel"]
    assert len(kk) and all(len(g) == 3 for g in kk["grid"]) and (kk["blocks per SM"] > 0).all()
    np.testing.assert_allclose(k["dur (us)"].sum(), ops["device_time (us)"].sum(), rtol=1e-9)
    by_op = k.groupby("row_id")[["flops"]].sum(min_count=1)["flops"].dropna()
    np.testing.assert_allclose(by_op.to_numpy(), ops.set_index("row_id").loc[by_op.index, "flops"].to_numpy(),
                               rtol=1e-9)

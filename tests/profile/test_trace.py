"""kprof.analyze.trace: loading Chrome traces, the op table, module/phase attribution, step windows.

CPU traces are real (torch.profiler on this machine: checked-in tests/data/*.json.gz and a fresh
one recorded here); the GPU-shaped trace is synthetic, written by hand below from the Kineto
format (a GPU trace cannot be recorded on a CPU machine); tests marked gpu record a real one.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kprof.analyze import trace
from kprof.errors import KprofError

DATA = Path(__file__).parents[1] / "data"


def _load_make_traces():
    spec = importlib.util.spec_from_file_location("make_traces", DATA / "make_traces.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


make_traces = _load_make_traces()


@pytest.fixture(scope="module")
def mlp_events():
    return trace.load_trace(DATA / "mlp_cpu.json.gz")


@pytest.fixture(scope="module")
def fresh_mlp_events(tmp_path_factory):
    model, step = make_traces.mlp_step()
    path = make_traces.record(model, step, 2, tmp_path_factory.mktemp("t") / "mlp.json")
    return trace.load_trace(path)


# ----------------------------------------------------------------------------------------------
# CPU traces


@pytest.mark.parametrize("which", ["checked_in", "fresh"])
def test_cpu_op_table_attribution(which, mlp_events, fresh_mlp_events):
    ev = mlp_events if which == "checked_in" else fresh_mlp_events
    assert ev.device_type == "cpu"
    ops = trace.op_table(ev)
    assert list(ops.columns[: len(trace.OP_COLUMNS)]) == trace.OP_COLUMNS
    assert sorted(ops["step"].unique()) == [0, 1]
    assert set(ops["phase"]) == {"fwd", "bwd", "optim", "other"}

    fwd = ops[ops["phase"] == "fwd"]
    assert set(fwd["module"]) == {"norm", "fc1", "act", "fc2"}
    assert dict(zip(fwd["module"], fwd["module_class"])) == {"norm": "LayerNorm", "fc1": "Linear", "act": "GELU",
                                                              "fc2": "Linear"}
    # Each Linear's forward matmul is in its module, once per step.
    addmm = fwd[fwd["op"] == "aten::addmm"]
    assert sorted(addmm["module"]) == ["fc1", "fc1", "fc2", "fc2"]
    # Backward: the weight-gradient matmuls of both Linears reach their modules through the
    # autograd sequence number; the GELU and LayerNorm backward kernels too.
    bwd = ops[ops["phase"] == "bwd"]
    assert {"fc1", "fc2"} <= set(bwd.loc[bwd["op"] == "aten::mm", "module"])
    assert "act" in set(bwd.loc[bwd["op"] == "aten::gelu_backward", "module"])
    assert "norm" in set(bwd.loc[bwd["op"] == "aten::native_layer_norm_backward", "module"])
    # Optimizer work is under "<optimizer>", phase optim; the loss (outside every module) is "other".
    assert set(ops.loc[ops["phase"] == "optim", "module"]) == {trace.OPTIMIZER}
    assert {"aten::_foreach_lerp_", "aten::_foreach_addcdiv_"} <= set(ops.loc[ops["phase"] == "optim", "op"])
    other = ops[ops["phase"] == "other"]
    assert "aten::square" in set(other["op"]) and set(other["module"]) == {trace.UNATTRIBUTED}


def test_cpu_self_times_do_not_double_count(mlp_events):
    """CPU-only trace: each op's time is its self time, so per step the ops add up exactly to the
    busy time (outermost op ranges), and nested ops never exceed their parent."""
    ops = trace.op_table(mlp_events)
    busy = trace.kernel_table(mlp_events).groupby("step")["dur (us)"].sum()
    per_step = ops.groupby("step")["device_time (us)"].sum()
    np.testing.assert_allclose(per_step.to_numpy(), busy.to_numpy(), rtol=1e-9)
    assert (ops["device_time (us)"] >= 0).all()
    assert (ops["device_time (us)"] <= ops["dur (us)"] + 1e-9).all()
    # parent_id points at another row of the same step
    ids = set(ops["op_id"])
    assert set(ops.loc[ops["parent_id"] >= 0, "parent_id"]) <= ids


def test_cpu_tensorlist_dtypes_and_display(mlp_events):
    ops = trace.op_table(mlp_events)
    lerp = ops[ops["op"] == "aten::_foreach_lerp_"].iloc[0]
    # TensorList element dtypes are not in the trace; the parameter dtype comes from AccumulateGrad.
    assert lerp["input_dtypes"][0] == ["float32"] * 6
    assert lerp["shapes"].startswith("[6 tensors]")
    mm = ops[(ops["op"] == "aten::addmm") & (ops["module"] == "fc1")].iloc[0]
    assert mm["shapes"] == "[64], [8, 32], [32, 64]" and mm["dtype"] == "fp32"


def test_step_windows_cpu(mlp_events):
    w = trace.step_windows(mlp_events)
    assert list(w["step"]) == [0, 1]
    assert (w["end (us)"] > w["start (us)"]).all()
    assert (w["start (us)"].iloc[1] >= w["end (us)"].iloc[0])
    np.testing.assert_allclose(w["device start (us)"], w["start (us)"])


def test_trace_dtype_names_match_profiler(tmp_path):
    """The profiler's element type names map to the right torch dtypes."""
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    xs = [torch.zeros(3, dtype=d) for d in dtypes]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
        for x in xs:
            x.clone()
    p.export_chrome_trace(str(tmp_path / "t.json"))
    evs = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    seen = [e["args"]["Input type"][0] for e in evs if e.get("name") == "aten::clone"]
    assert [trace.TRACE_DTYPES[t] for t in seen] == [str(d).removeprefix("torch.") for d in dtypes]


def test_load_errors(tmp_path):
    with pytest.raises(KprofError, match="does not exist"):
        trace.load_trace(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(KprofError, match="truncated"):
        trace.load_trace(bad)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(KprofError, match="not a Chrome trace"):
        trace.load_trace(other)
    empty = tmp_path / "empty.json.gz"
    with gzip.open(empty, "wt") as f:
        json.dump({"traceEvents": []}, f)
    ev = trace.load_trace(empty)
    assert trace.op_table(ev).empty and ev.device_type == "cpu"


# ----------------------------------------------------------------------------------------------
# A synthetic GPU trace (hand-written in Kineto's format; not recorded)

T0 = 1_000_000.0  # us


def _x(name, cat, ts, dur, tid=1, pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur, "args": args}


def _op(name, ts, dur, tid=1, seq=None, dims=(), types=(), **extra):
    args = {"External id": extra.pop("ext", 0), "Input Dims": [list(d) for d in dims], "Input type": list(types),
            "Input Strides": [[] for _ in dims], "Concrete Inputs": ["" for _ in dims]}
    if seq is not None:
        args["Sequence number"] = seq
        args["Fwd thread id"] = 0 if tid == 1 else 1
    return _x(name, "cpu_op", ts, dur, tid, **args)


def _launch(ts, corr, tid=1, name="cudaLaunchKernel", cat="cuda_runtime"):
    return _x(name, cat, ts, 1.0, tid, correlation=corr, cbid=211)


def _kernel(name, ts, dur, corr, stream=7, cat="kernel"):
    return _x(name, cat, ts, dur, tid=stream, pid=0, correlation=corr, stream=stream, device=0)


def synthetic_gpu_trace() -> dict:
    """Two steps on one GPU. Host thread 1 runs forward and the optimizer; thread 2 (autograd's
    device thread) runs backward. Kernels lag their launches, as on a real GPU.

    step 0 (host 0-100 us): fc (Linear) forward: aten::linear > aten::addmm launching gemm (corr 1);
      a Triton kernel launched by cuLaunchKernel straight from the `act` module (no aten op,
      corr 2); backward on thread 2: MmBackward0 (seq 5 = the addmm) > aten::mm launching 2
      kernels (corr 3, 4); optimizer: _foreach_add_ (corr 5); an NCCL kernel with no launch event.
    step 1 (host 100-200 us): the fc forward again (corr 11), kernel 150-170 us.
    """
    ev = [
        _x("kprof.step#0", "user_annotation", 0, 100),
        _x("kprof.step#1", "user_annotation", 100, 100),
        _x("kprof.module::Net", "user_annotation", 1, 40),
        _x("kprof.module:fc:Linear", "user_annotation", 2, 20),
        _op("aten::linear", 3, 15, seq=5, dims=[(8, 32), (64, 32), (64,)], types=["c10::BFloat16"] * 3),
        _op("aten::addmm", 5, 10, seq=5, dims=[(64,), (8, 32), (32, 64), (), ()],
            types=["c10::BFloat16"] * 3 + ["Scalar", "Scalar"], ext=42),
        _launch(6, 1),
        _x("kprof.module:act:GELU", "user_annotation", 25, 10),
        _launch(26, 2, name="cuLaunchKernel", cat="cuda_driver"),
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 45, 20, tid=2,
           **{"Sequence number": 5, "Fwd thread id": 1}),
        _x("MmBackward0", "cpu_op", 46, 18, tid=2),
        _op("aten::mm", 47, 15, tid=2, dims=[(8, 64), (64, 32)], types=["c10::BFloat16"] * 2),
        _launch(48, 3, tid=2),
        _launch(50, 4, tid=2),
        _x("Optimizer.step#AdamW.step", "user_annotation", 70, 20),
        _op("aten::_foreach_add_", 72, 10, dims=[[(64, 32), (64,)], ()], types=["TensorList", "Scalar"]),
        _launch(73, 5),
        # the GPU-side copy of a record_function range: must not count as device work
        _x("kprof.module:fc:Linear", "gpu_user_annotation", 10, 30, tid=7, pid=0),
        _kernel("sm90_xmma_gemm_bf16", 10, 30, 1),
        _kernel("triton_gelu_kernel", 45, 5, 2),
        _kernel("gemm_dgrad", 60, 8, 3),
        _kernel("gemm_wgrad", 68, 12, 4, stream=8),
        _kernel("multi_tensor_apply_kernel", 95, 10, 5),  # launched in step 0, ends after it
        # correlation ids are handed out in launch order, process-wide: 6 follows step 0's 5
        _kernel("ncclDevKernel_AllReduce_Sum_bf16", 82, 6, 6, stream=9),
        # step 1
        _x("kprof.module::Net", "user_annotation", 101, 40),
        _x("kprof.module:fc:Linear", "user_annotation", 102, 20),
        _op("aten::linear", 103, 15, seq=9, dims=[(8, 32), (64, 32), (64,)], types=["c10::BFloat16"] * 3),
        _op("aten::addmm", 105, 10, seq=9, dims=[(64,), (8, 32), (32, 64), (), ()],
            types=["c10::BFloat16"] * 3 + ["Scalar", "Scalar"]),
        _launch(106, 11),
        _kernel("sm90_xmma_gemm_bf16", 150, 20, 11),
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
    ]
    return {"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}]}


@pytest.fixture(scope="module")
def gpu_events(tmp_path_factory):
    p = tmp_path_factory.mktemp("gpu") / "synthetic.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(synthetic_gpu_trace(), f)
    return trace.load_trace(p)


def test_gpu_kernels_belong_to_innermost_launching_op(gpu_events):
    assert gpu_events.device_type == "cuda"
    ops = trace.op_table(gpu_events)
    key = ops.set_index(["step", "op", "module"])
    fwd = key.loc[(0, "aten::addmm", "fc")]
    assert (fwd["phase"], fwd["module_class"], fwd["device_time (us)"], fwd["n_kernels"], fwd["kernel"]) == \
        ("fwd", "Linear", 30.0, 1, "sm90_xmma_gemm_bf16")
    # Backward: two kernels of one aten::mm on the autograd thread, attributed to fc via seq 5.
    bwd = key.loc[(0, "aten::mm", "fc")]
    assert (bwd["phase"], bwd["device_time (us)"], bwd["n_kernels"], bwd["kernel"]) == ("bwd", 20.0, 2, "gemm_wgrad")
    # A kernel launched outside any op keeps its module and takes the kernel's name as op.
    tri = key.loc[(0, "triton_gelu_kernel", "act")]
    assert (tri["phase"], tri["device_time (us)"], tri["op_id"]) == ("fwd", 5.0, -1)
    opt = key.loc[(0, "aten::_foreach_add_", trace.OPTIMIZER)]
    assert (opt["phase"], opt["device_time (us)"]) == ("optim", 10.0)
    # No launch event: still in the table, unattributed, stepped by its correlation id.
    nccl = key.loc[(0, "ncclDevKernel_AllReduce_Sum_bf16", trace.UNATTRIBUTED)]
    assert nccl["device_time (us)"] == 6.0
    # aten::linear launched nothing itself: not a row; addmm's parent is not a row either.
    assert "aten::linear" not in set(ops["op"])
    assert (ops["parent_id"] == -1).all()
    # Nothing lost: the table holds every kernel's time (the gpu_user_annotation is not a kernel).
    assert ops["device_time (us)"].sum() == 30 + 5 + 8 + 12 + 10 + 6 + 20
    s1 = ops[ops["step"] == 1]
    assert list(s1["op"]) == ["aten::addmm"] and s1["device_time (us)"].iloc[0] == 20.0


def test_gpu_step_windows_and_kernel_table(gpu_events):
    k = trace.kernel_table(gpu_events)
    assert list(k.groupby("step").size()) == [6, 1]
    w = trace.step_windows(gpu_events).set_index("step")
    # Device window: first kernel launched in the step -> first kernel launched in the next one.
    assert (w.loc[0, "device start (us)"], w.loc[0, "device end (us)"]) == (10.0, 150.0)
    # Last step: to the later of its last kernel's end (170) and the host window's end (200).
    assert (w.loc[1, "device start (us)"], w.loc[1, "device end (us)"]) == (150.0, 200.0)


def test_gpu_trace_kernel_without_runtime_event_uses_external_id(tmp_path):
    """Traces recorded without runtime activity: the kernel's External id names its op."""
    t = synthetic_gpu_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if e.get("cat") not in ("cuda_runtime", "cuda_driver")]
    for e in t["traceEvents"]:
        if e.get("name") == "sm90_xmma_gemm_bf16" and e["args"]["correlation"] == 1:
            e["args"]["External id"] = 42
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    ops = trace.op_table(trace.load_trace(p))
    row = ops[ops["kernel"] == "sm90_xmma_gemm_bf16"].iloc[0]
    assert (row["op"], row["module"], row["step"]) == ("aten::addmm", "fc", 0)


def _with_events(tmp_path, extra: list, drop=lambda e: False) -> trace.TraceEvents:
    t = synthetic_gpu_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if not drop(e)] + extra
    p = tmp_path / "t.json"
    p.write_text(json.dumps(t))
    return trace.load_trace(p)


@pytest.mark.parametrize("name,cat", [
    ("cuLaunchKernelEx", "cuda_driver"),  # cuBLAS nvjet / cuDNN SDPA kernels under CUDA 13
    ("cudaLaunchKernelExC", "cuda_runtime"),
    ("cudaSomeFutureLaunch", "some_new_category"),  # any host event with a correlation arg
])
def test_gpu_any_event_with_a_correlation_links_its_kernel(tmp_path, name, cat):
    # The backward aten::mm's second kernel (corr 4) launched by a differently named event.
    ev = _with_events(tmp_path, [_launch(50, 4, tid=2, name=name, cat=cat)],
                      drop=lambda e: e.get("args", {}).get("correlation") == 4 and e["cat"] != "kernel")
    ops = trace.op_table(ev)
    bwd = ops.set_index(["step", "op", "module"]).loc[(0, "aten::mm", "fc")]
    assert (bwd["phase"], bwd["n_kernels"], bwd["device_time (us)"]) == ("bwd", 2, 20.0)
    assert trace.UNATTRIBUTED not in set(ops.loc[ops["kernel"] == "gemm_wgrad", "module"])


def test_gpu_kernels_launched_before_the_recording_are_in_no_step(tmp_path):
    """When recording starts, the GPU still runs the previous step's kernels (the host is ahead):
    they are in the trace, inside step 0's window by device time, without launch events. Their
    correlation ids are lower than every recorded launch's: no step, not unattributed time."""
    prev = [_kernel("prev_step_wgrad", 1, 4, 0), _kernel("prev_step_multi_tensor_apply", 5, 3, 0)]
    ev = _with_events(tmp_path, prev)
    ops = trace.op_table(ev)
    assert not ops["kernel"].str.startswith("prev_step").any()
    assert ops["device_time (us)"].sum() == 30 + 5 + 8 + 12 + 10 + 6 + 20
    k = trace.kernel_table(ev)
    assert list(k.groupby("step").size()) == [6, 1]
    w = trace.step_windows(ev).set_index("step")
    assert w.loc[0, "device start (us)"] == 10.0
    # An unlinked kernel launched between two recorded launches belongs to their step.
    ev = _with_events(tmp_path, [_kernel("unlinked_mid_step", 96, 2, 12)])
    row = trace.op_table(ev).set_index("kernel").loc["unlinked_mid_step"]
    assert (row["step"], row["module"]) == (1, trace.UNATTRIBUTED)


# ----------------------------------------------------------------------------------------------
# Real GPU trace (the lead runs these on the H200)


@pytest.mark.gpu
def test_gpu_real_trace_attribution(tmp_path):
    torch.manual_seed(0)
    model = make_traces.MLP(256, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(512, 256, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    path = make_traces.record(model, step, 2, tmp_path / "gpu.json.gz", warmup=2)
    ev = trace.load_trace(path)
    assert ev.device_type == "cuda"
    ops = trace.op_table(ev)
    assert (ops["device_time (us)"] > 0).all()
    fwd = ops[(ops["phase"] == "fwd") & ops["op"].isin(["aten::addmm", "aten::mm"])]
    assert {"fc1", "fc2"} <= set(fwd["module"])
    bwd = ops[(ops["phase"] == "bwd") & (ops["op"] == "aten::mm")]
    assert {"fc1", "fc2"} <= set(bwd["module"])  # backward runs on autograd's device thread
    assert (ops.loc[ops["phase"] == "optim", "module"] == trace.OPTIMIZER).all()
    # every kernel of the recorded steps is in the table
    k = trace.kernel_table(ev)
    np.testing.assert_allclose(ops["device_time (us)"].sum(), k["dur (us)"].sum(), rtol=1e-9)
    w = trace.step_windows(ev)
    assert (w["device end (us)"] > w["device start (us)"]).all()

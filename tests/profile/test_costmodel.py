"""kprof.analyze.costmodel: exact FLOPs/bytes for known ops, exclusive costs over nested rows, coverage of
real training steps (tiny HF Llama, the GPT example) recorded on this CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from kprof.analyze import costmodel, trace
from kprof.analyze import tables as analysis
from kprof.analyze.costmodel import inclusive_cost

ROOT = Path(__file__).parents[2]
DATA = ROOT / "tests" / "data"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


make_traces = _load("make_traces", DATA / "make_traces.py")


def cost(op, shapes, dtypes, strides=None, concrete=None, types=None):
    """inclusive_cost with the trace's argument layout; dtypes are torch names or non-tensor types."""
    n = len(shapes)
    strides = strides or [_contig(s) if isinstance(d, str) and d not in ("Scalar", "ScalarList", "") else []
                          for s, d in zip(shapes, dtypes)]
    types = types or [_trace_type(d) for d in dtypes]
    c, _ = inclusive_cost(op, shapes, dtypes, strides, concrete or [""] * n, types)
    return c


def _contig(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return list(reversed(st))


def _trace_type(d):
    inv = {v: k for k, v in trace.TRACE_DTYPES.items()}
    return inv.get(d, d) if isinstance(d, str) else "TensorList"


def record_ops(tmp_path, model, step, steps=1, warmup=1):
    path = make_traces.record(model, step, steps, tmp_path / "t.json", warmup=warmup)
    ev = trace.load_trace(path)
    return ev, costmodel.annotate(trace.op_table(ev))


# ----------------------------------------------------------------------------------------------
# Exact FLOPs and bytes


@pytest.mark.parametrize("shape", [(8, 32), (2, 5, 32)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_flops_exact(tmp_path, shape, bias):
    """A Linear's rows (aten::linear > t, addmm/matmul > mm, copy_ ...) add up to exactly 2*M*N*K,
    forward; and the backward of a Linear whose input needs grad to exactly 2 * 2*M*N*K + bias."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 48, bias=bias)
    x = torch.randn(*shape, requires_grad=True)
    M, K, N = x.numel() // 32, 32, 48

    def step():
        lin(x).sum().backward()

    _, ops = record_ops(tmp_path, lin, step)
    fwd = ops[(ops["module"] == "") & (ops["phase"] == "fwd")]
    assert fwd["cost_known"].all()
    assert fwd["flops"].sum() == 2 * M * N * K
    bwd = ops[(ops["module"] == "") & (ops["phase"] == "bwd")]
    # grad_input and grad_weight matmuls, plus the bias gradient's reduction (one add per element)
    assert bwd["flops"].sum() == 2 * (2 * M * N * K) + (M * N if bias else 0)


def test_linear_bytes_exact_cpu_addmm():
    # addmm(bias[N], x[M,K], w.T[K,N]) in fp32: read 3 operands, write M x N
    M, K, N = 8, 32, 48
    c = cost("aten::addmm", [[N], [M, K], [K, N], [], []], ["float32"] * 3 + ["Scalar", "Scalar"],
             strides=[[1], [K, 1], [1, K], [], []], concrete=["", "", "", "1", "1"])
    assert c.flops == 2 * M * N * K
    assert c.bytes == 4 * (N + M * K + K * N + M * N)


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_elementwise_bytes_exact(dtype, size):
    M, N = 64, 48
    # same shapes: read 2, write 1
    assert cost("aten::add", [[M, N], [M, N], []], [dtype, dtype, "Scalar"], concrete=["", "", "1"]) == \
        (M * N, 3 * M * N * size)
    # broadcast [N] against [M, N]: the small operand is read once
    assert cost("aten::mul", [[M, N], [N]], [dtype, dtype]) == (M * N, (2 * M * N + N) * size)
    # an expanded operand (stride 0) is read once
    assert cost("aten::mul", [[M, N], [M, N]], [dtype, dtype], strides=[[N, 1], [0, 1]]) == \
        (M * N, (2 * M * N + N) * size)
    # in-place: read self and other, write self
    assert cost("aten::add_", [[M, N], [M, N], []], [dtype, dtype, "Scalar"]) == (M * N, 3 * M * N * size)
    # unary with a Python scalar
    assert cost("aten::mul", [[M, N], []], [dtype, "Scalar"], concrete=["", "0.5"]) == (M * N, 2 * M * N * size)
    # comparisons write bool
    assert cost("aten::gt", [[M, N], []], [dtype, "Scalar"], concrete=["", "0"]) == (M * N, M * N * size + M * N)
    # silu: 5 FLOPs per element (x * sigmoid(x))
    assert cost("aten::silu", [[M, N]], [dtype]) == (5 * M * N, 2 * M * N * size)


def test_elementwise_type_promotion():
    M, N = 16, 8
    # bf16 + fp32 -> fp32 output
    assert cost("aten::add", [[M, N], [M, N], []], ["bfloat16", "float32", "Scalar"]).bytes == M * N * (2 + 4 + 4)
    # a 0-d fp32 tensor does not promote a bf16 tensor
    assert cost("aten::mul", [[M, N], []], ["bfloat16", "float32"]).bytes == M * N * 2 * 2 + 4


def test_copies_and_casts():
    M, N = 32, 16
    # _to_copy fp32 -> bf16 (ScalarType 15): read 4 B, write 2 B per element
    c = cost("aten::_to_copy", [[M, N], [], [], [], [], [], []], ["float32", "Scalar", "", "", "", "Scalar", ""],
             concrete=["", "15", "", "", "", "False", ""])
    assert c == (0, M * N * 6)
    # copy_ from a broadcast source
    assert cost("aten::copy_", [[M, N], [M, N], []], ["float32", "float32", "Scalar"],
                strides=[[N, 1], [0, 1], []]) == (0, (M * N + N) * 4)
    assert cost("aten::clone", [[M, N], []], ["bfloat16", ""]) == (0, M * N * 4)
    assert cost("aten::fill_", [[M, N], []], ["float32", "Scalar"], concrete=["", "0."]) == (0, M * N * 4)


def test_scalar_type_codes_match_profiler(tmp_path):
    """The dtype codes a trace records for `x.to(dtype)` are the ones costmodel.SCALAR_TYPES maps."""
    dts = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8,
           torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    x = torch.ones(2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
        for d in dts:
            x.to(d)
    p.export_chrome_trace(str(tmp_path / "t.json"))
    evs = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    codes = [int(e["args"]["Concrete Inputs"][1]) for e in evs if e.get("name") == "aten::_to_copy"]
    assert [costmodel.SCALAR_TYPES[c] for c in codes] == [str(d).removeprefix("torch.") for d in dts]


def test_views_cost_nothing_and_are_known():
    for op, shapes, dtypes in [("aten::t", [[4, 8]], ["float32"]), ("aten::view", [[4, 8], []], ["float32", "ScalarList"]),
                               ("aten::transpose", [[4, 8], [], []], ["float32", "Scalar", "Scalar"]),
                               ("aten::expand", [[8], [], []], ["float32", "ScalarList", "Scalar"]),
                               ("aten::as_strided", [[4, 8], [], [], []], ["float32", "ScalarList", "ScalarList", ""])]:
        assert cost(op, shapes, dtypes) == (0, 0), op


def test_unknown_ops_are_marked():
    assert cost("aten::some_op_kprof_has_no_formula_for", [[4]], ["float32"]) is None
    assert cost("aten::index", [[5, 3], []], ["float32", ""]) is None  # indices are not recorded
    assert cost("mylib::custom", [[4]], ["float32"]) is None


@pytest.mark.parametrize("fn,args", [
    (torch.mm, ((64, 32), (32, 48))),
    (torch.bmm, ((4, 16, 32), (4, 32, 8))),
])
def test_matmul_flops_match_torch_flop_counter(fn, args):
    ts = [torch.randn(*s) for s in args]
    with FlopCounterMode(display=False) as fc:
        fn(*ts)
    op = f"aten::{fn.__name__}"
    c = cost(op, [list(s) for s in args], ["float32"] * len(args))
    assert c.flops == fc.get_total_flops()


def test_attention_flops_gqa_and_causal():
    B, Hq, Hkv, S, D = 2, 8, 2, 64, 16
    q, k, v = [B, Hq, S, D], [B, Hkv, S, D], [B, Hkv, S, D]
    full = 4 * B * Hq * S * S * D  # QK^T and PV, 2 FLOPs per multiply-add
    types = ["float32"] * 3 + ["Scalar", "Scalar", "", "Scalar"]
    c = cost("aten::_scaled_dot_product_flash_attention_for_cpu", [q, k, v, [], [], [], []], types,
             concrete=["", "", "", "0.", "False", "", "0.25"])
    assert c.flops == full
    # causal: only the S*(S+1)/2 unmasked (query, key) pairs
    c = cost("aten::_scaled_dot_product_flash_attention_for_cpu", [q, k, v, [], [], [], []], types,
             concrete=["", "", "", "0.", "True", "", "0.25"])
    assert c.flops == pytest.approx(full * (S * (S + 1) / 2) / (S * S))
    # bytes: q, k, v, out and fp32 log-sum-exp
    assert c.bytes == 4 * (B * Hq * S * D * 2 + 2 * B * Hkv * S * D) + 4 * B * Hq * S


def test_cudnn_attention_ops_torch_2_11():
    """aten::_cudnn_attention_forward/_backward launch the cuDNN SDPA kernels on sm90 (argument
    layout as in the H200 Llama-1B trace: q (B, Hq, S, D), GQA k/v, is_causal at 10 / 14)."""
    B, Hq, Hkv, S, D = 2, 8, 2, 64, 16
    q, k, v = [B, Hq, S, D], [B, Hkv, S, D], [B, Hkv, S, D]
    causal = 4 * B * Hq * S * S * D * (S * (S + 1) / 2) / (S * S)
    f = cost("aten::_cudnn_attention_forward", [q, k, v] + [[]] * 10,
             ["bfloat16"] * 3 + ["", "", ""] + ["Scalar"] * 7,
             concrete=[""] * 6 + [str(S), str(S), "True", "0.", "True", "False", "0.25"])
    assert f.flops == pytest.approx(causal)
    assert f.bytes == 2 * (B * Hq * S * D * 2 + 2 * B * Hkv * S * D) + 4 * B * Hq * S
    b = cost("aten::_cudnn_attention_backward", [q, q, k, v, q, [B, Hq, S, 1]] + [[]] * 10,
             ["bfloat16"] * 5 + ["float32", "int64", "int64", "", "", ""] + ["Scalar"] * 5,
             concrete=[""] * 11 + [str(S), str(S), "0.", "True", "0.25"])
    assert b.flops == pytest.approx(2.5 * causal)  # dQ, dK, dV, dP and the recomputed S
    assert "_cudnn_attention_forward" in costmodel.TENSOR_CORE_OPS


@pytest.mark.parametrize("op", ["aten::_fused_adamw_", "aten::_foreach_add_"])
def test_truncated_tensorlists_are_unknown_not_zero(op):
    """The profiler drops the shapes of TensorLists longer than 30 (`Input Dims` [] each): such a
    record must give an unknown cost (it was 0 FLOPs / 0 bytes, classed latency-bound, for the
    6 ms/step fused AdamW of a 1B model)."""
    n_lists = 6 if "adam" in op else 2
    shapes = [[] for _ in range(n_lists)] + [[]]
    dtypes = ["TensorList"] * n_lists + ["Scalar"]
    types = ["TensorList"] * n_lists + ["Scalar"]
    c, _ = inclusive_cost(op, shapes, dtypes, [[] for _ in shapes], [""] * len(shapes), types)
    assert c is None
    # the same op with its shapes recorded has a cost
    rec = [[[64, 32], [64]] for _ in range(n_lists)] + [[]]
    c, _ = inclusive_cost(op, rec, [["float32"] * 2 for _ in range(n_lists)] + ["Scalar"],
                          [[[32, 1], [1]] for _ in range(n_lists)] + [[]], [""] * len(rec), types)
    assert c is not None and c.bytes > 0


def test_fused_adamw_bytes():
    shapes = [[64, 32], [64]]
    n = 64 * 32 + 64
    lists = [shapes, shapes, shapes, shapes, [], [[], []]]
    dtypes = [["float32"] * 2] * 4 + [[], ["float32"] * 2] + ["Scalar"] * 7 + ["", ""]
    c = cost("aten::_fused_adamw_", lists + [[]] * 9, dtypes, strides=[[] for _ in range(15)],
             types=["TensorList"] * 6 + ["Scalar"] * 7 + ["", ""])
    # read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
    assert c.bytes == 7 * n * 4
    assert c.flops == costmodel.ADAM_FLOPS_PER_ELEM * n


def test_foreach_ops():
    shapes = [[64, 32], [64]]
    n = 64 * 32 + 64
    c = cost("aten::_foreach_mul_", [shapes, []], [["bfloat16"] * 2, "Scalar"], strides=[[], []],
             types=["TensorList", "Scalar"], concrete=["", "0.9"])
    assert c == (n, 2 * n * 2)
    c = cost("aten::_foreach_addcmul_", [shapes, shapes, shapes, []], [["float32"] * 2] * 3 + ["Scalar"],
             strides=[[], [], [], []], types=["TensorList"] * 3 + ["Scalar"])
    assert c == (3 * n, 4 * n * 4)


def test_kprof_ops_use_the_kernel_registry():
    from kprof.kernels import rms_norm  # noqa: F401  registers its KernelSpec
    from kprof.kernels.registry import TensorMeta, op_cost

    expected = op_cost("kprof::rms_norm_fwd", [TensorMeta((64, 128), torch.bfloat16), TensorMeta((128,), torch.bfloat16)])
    assert expected is not None
    c = cost("kprof::rms_norm_fwd", [[64, 128], [128], []], ["bfloat16", "bfloat16", "Scalar"])
    assert c == expected


def test_exclusive_cost_over_nested_rows():
    """annotate charges a parent only what its child rows do not do."""
    import pandas as pd

    M, K, N = 8, 32, 48
    rows = [  # aten::linear (composite) > aten::addmm > aten::copy_ (bias broadcast into out)
        dict(op="aten::linear", input_shapes=[[M, K], [N, K], [N]], input_dtypes=["float32"] * 3,
             input_strides=[[K, 1], [K, 1], [1]], concrete_inputs=["", "", ""], input_types=["float"] * 3,
             op_id=1, parent_id=-1),
        dict(op="aten::addmm", input_shapes=[[N], [M, K], [K, N], [], []],
             input_dtypes=["float32"] * 3 + ["Scalar", "Scalar"], input_strides=[[1], [K, 1], [1, K], [], []],
             concrete_inputs=["", "", "", "1", "1"], input_types=["float"] * 3 + ["Scalar"] * 2, op_id=2, parent_id=1),
        dict(op="aten::copy_", input_shapes=[[M, N], [M, N], []], input_dtypes=["float32", "float32", "Scalar"],
             input_strides=[[N, 1], [0, 1], []], concrete_inputs=["", "", "False"],
             input_types=["float", "float", "Scalar"], op_id=3, parent_id=2),
    ]
    ops = costmodel.annotate(pd.DataFrame(rows).assign(n_kernels=0, **{"device_time (us)": 1.0}))
    assert list(ops["flops"]) == [0, 2 * M * N * K, 0]
    assert list(ops["bytes"]) == [0, 4 * (M * K + K * N), 4 * (N + M * N)]
    assert ops["bytes"].sum() == 4 * (N + M * K + K * N + M * N)  # the addmm's minimal bytes
    assert ops["cost_known"].all() and list(ops["tensor_core"]) == [True, True, False]


# ----------------------------------------------------------------------------------------------
# Coverage of real training steps


def test_coverage_checked_in_traces():
    for name in ("mlp_cpu", "llama_cpu"):
        ops = costmodel.annotate(trace.op_table(trace.load_trace(DATA / f"{name}.json.gz")))
        assert analysis.coverage(ops) >= 0.95, name


@pytest.mark.parametrize("fused_adam", [False, True], ids=["foreach_adamw", "fused_adamw"])
def test_coverage_tiny_hf_llama(tmp_path, fused_adam):
    pytest.importorskip("transformers")
    model, step = make_traces.tiny_llama(fused_adam=fused_adam)
    _, ops = record_ops(tmp_path, model, step)
    cov = analysis.coverage(ops)
    unknown = ops[~ops["cost_known"]].groupby("op")["device_time (us)"].sum().sort_values(ascending=False)
    assert cov >= 0.95, f"coverage {cov:.3f}; uncosted: {unknown.head(10).to_dict()}"
    # the FLOPs are there: forward matmuls of every Linear in the model
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    fwd = ops[(ops["phase"] == "fwd") & (ops["flops"] > 0)]
    assert linears <= set(fwd["module"])


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_fused_adamw_over_more_than_30_parameters(tmp_path, micro_batches):
    """The profiler drops the shapes of TensorLists longer than 30; trace.op_table takes the
    fused optimizer's from the step's gradients (divided by the micro-batches per step)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(16)])  # 32 parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(4, 8)

    def step():
        for _ in range(micro_batches):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ev, ops = record_ops(tmp_path, model, step)
    raw = ev.host[ev.host["name"] == "aten::_fused_adamw_"]["args"].iloc[0]
    assert raw["Input Dims"][:6] == [[]] * 6  # the truncation this works around
    adam = ops[ops["op"] == "aten::_fused_adamw_"]
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert len(adam) == 1 and adam["cost_known"].all()
    # fp32: read param, grad, exp_avg, exp_avg_sq, write three of them (7 x 4 B per element;
    # the 0-d step counts are not modelled, as in test_fused_adamw_bytes)
    assert adam["bytes"].iloc[0] == 7 * 4 * n
    assert adam["flops"].iloc[0] == costmodel.ADAM_FLOPS_PER_ELEM * n
    assert adam["shapes"].iloc[0].startswith("[32 tensors]")


def test_coverage_gpt_example(tmp_path):
    path = ROOT / "examples" / "gpt_train.py"
    if not path.exists():
        pytest.skip("examples/gpt_train.py not there yet")
    ex = _load("gpt_train", path)
    torch.manual_seed(0)
    cfg = ex.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = ex.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    y = torch.randint(0, cfg.vocab_size, (2, 32))

    def step():
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    _, ops = record_ops(tmp_path, model, step)
    cov = analysis.coverage(ops)
    unknown = ops[~ops["cost_known"]].groupby("op")["device_time (us)"].sum().sort_values(ascending=False)
    assert cov >= 0.95, f"coverage {cov:.3f}; uncosted: {unknown.head(10).to_dict()}"
    # the hand-written attention's softmax is costed where the model calls it
    sm = ops[(ops["op"] == "aten::_softmax") & ops["module"].str.endswith("attn")]
    assert len(sm) == cfg.n_layer and sm["cost_known"].all()


@pytest.mark.gpu
def test_gpu_coverage_tiny_llama_bf16(tmp_path):
    pytest.importorskip("transformers")
    model, step = make_traces.tiny_llama(hidden=256, layers=2, heads=8, kv_heads=2, seq=256, batch=4)
    model = model.cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ids = torch.randint(0, 128, (4, 256), device="cuda")

    def gpu_step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ev, ops = record_ops(tmp_path, model, gpu_step, steps=2, warmup=2)
    assert ev.device_type == "cuda"
    cov = analysis.coverage(ops)
    unknown = ops[~ops["cost_known"]].groupby("op")["device_time (us)"].sum().sort_values(ascending=False)
    assert cov >= 0.95, f"coverage {cov:.3f}; uncosted: {unknown.head(10).to_dict()}"
    # flash/efficient attention kernels are costed
    attn = ops[ops["op"].str.contains("attention")]
    assert len(attn) and attn["cost_known"].all()


# Hand counts for the formulas of gather/scatter, sort/select, grouped matmuls, embedding and SDPA
# backward. Argument layouts as torch 2.13's profiler records them (checked on this CPU).
F4, I8 = 4, 8  # bytes of float32, int64


def test_gather_scatter_hand_counts():
    # index_select(x [6, 5], dim 0, index [3]) -> [3, 5]: index, the 15 picked, the 15 written
    c = cost("aten::index_select", [[6, 5], [], [3]], ["float32", "Scalar", "int64"], concrete=["", "0", ""])
    assert c == (0, 3 * I8 + 2 * 15 * F4)
    # gather(x [6, 5], dim 1, index [3, 5]) -> [3, 5]
    c = cost("aten::gather", [[6, 5], [], [3, 5], []], ["float32", "Scalar", "int64", "Scalar"],
             concrete=["", "1", "", "False"])
    assert c == (0, 15 * I8 + 2 * 15 * F4)
    # scatter_add_(x [6, 5], 0, index [2, 5], src [2, 5]): read src, index; read+write 10 of x
    c = cost("aten::scatter_add_", [[6, 5], [], [2, 5], [2, 5]], ["float32", "Scalar", "int64", "float32"],
             concrete=["", "0", "", ""])
    assert c == (10, 10 * F4 + 10 * I8 + 2 * 10 * F4)
    # index_add_(x [6, 5], 0, index [3], source [3, 5], alpha 1): 15 adds
    c = cost("aten::index_add_", [[6, 5], [], [3], [3, 5], []], ["float32", "Scalar", "int64", "float32", "Scalar"],
             concrete=["", "0", "", "", "1"])
    assert c == (15, 15 * F4 + 3 * I8 + 2 * 15 * F4)


def test_index_put_from_values():
    """x.index_put_((i,), v [3, 5], accumulate=True): the profiler records no indices ('' type),
    so the region comes from the values; a broadcast 0-d value leaves it unknown."""
    types = ["float", "", "float", "Scalar"]
    c = cost("aten::index_put_", [[6, 5], [], [3, 5], []], ["float32", "", "float32", "Scalar"],
             concrete=["", "", "", "True"], types=types)
    assert c == (15, 15 * F4 + 2 * 15 * F4)
    c = cost("aten::_index_put_impl_", [[6, 5], [], [3, 5], [], []], ["float32", "", "float32", "Scalar", "Scalar"],
             concrete=["", "", "", "False", "False"], types=types + ["Scalar"])
    assert c == (0, 15 * F4 + 15 * F4)
    assert cost("aten::index_put_", [[6, 5], [], [], []], ["float32", "", "float32", "Scalar"],
                concrete=["", "", "", "False"], types=types) is None


def test_sort_topk_histc_hand_counts():
    x = [6, 5]
    # sort along dim 1: 6 rows of 5, ceil(log2 5) = 3 comparisons per element; values + int64 indices
    c = cost("aten::sort", [x, [], []], ["float32", "Scalar", "Scalar"], concrete=["", "1", "False"])
    assert c == (30 * 3, 30 * F4 + 30 * F4 + 30 * I8)
    c = cost("aten::sort", [x, [], [], []], ["float32"] + ["Scalar"] * 3, concrete=["", "False", "0", "False"])
    assert c == (30 * 3, 30 * F4 + 30 * F4 + 30 * I8)  # sort.stable along dim 0: ceil(log2 6) = 3
    # topk(k=2, dim=1): one comparison per element, [6, 2] values and indices
    c = cost("aten::topk", [x, [], [], [], []], ["float32"] + ["Scalar"] * 4, concrete=["", "2", "1", "True", "True"])
    assert c == (30, 30 * F4 + 12 * F4 + 12 * I8)
    # histc(bins=4): 3 FLOPs per element, 4 counts written
    c = cost("aten::histc", [x, [], [], []], ["float32"] + ["Scalar"] * 3, concrete=["", "4", "0", "0"])
    assert c == (90, 30 * F4 + 4 * F4)


def test_data_dependent_ops_lower_bound_hand_counts():
    """Output sizes set by the values: read the inputs, one FLOP per element; bincount also
    writes its minlength counts."""
    c = cost("aten::nonzero", [[64, 2]], ["bool"])
    assert c == (128, 128 * 1)
    # masked_select(x [6, 5] fp32, mask [6, 5] bool)
    c = cost("aten::masked_select", [[6, 5], [6, 5]], ["float32", "bool"])
    assert c == (30, 30 * F4 + 30 * 1)
    # bincount(ids [12] int64, weights None, minlength 8): 8 int64 counts
    c = cost("aten::bincount", [[12], [], []], ["int64", "", "Scalar"], concrete=["", "", "8"],
             types=["long int", "", "Scalar"])
    assert c == (12, 12 * I8 + 8 * I8)


def test_grouped_mm_hand_counts():
    """_grouped_mm over 2 groups (MoE experts): 2*M*N*K over the whole problem."""
    t = ["c10::BFloat16", "c10::BFloat16", "int", "", ""]
    dt = ["bfloat16", "bfloat16", "int32", "", ""]
    # 2d x 3d: a [8, 16] split by offs along M, b [2, 16, 4] -> [8, 4]
    c = cost("aten::_grouped_mm", [[8, 16], [2, 16, 4], [2], [], []], dt, types=t)
    assert c == (2 * 8 * 16 * 4, 8 * 16 * 2 + 2 * 16 * 4 * 2 + 2 * 4 + 8 * 4 * 2)
    # 2d x 2d (weight gradient): a [4, 10], b [10, 6] split along K=10 -> [2, 4, 6]
    c = cost("aten::_grouped_mm", [[4, 10], [10, 6], [2], [], []], dt, types=t)
    assert c == (2 * 4 * 10 * 6, 4 * 10 * 2 + 10 * 6 * 2 + 2 * 4 + 2 * 4 * 6 * 2)
    # 3d x 3d: batched [2, 8, 16] @ [2, 16, 4]
    c = cost("aten::_grouped_mm", [[2, 8, 16], [2, 16, 4], [], [], []], dt[:2] + ["", "", ""],
             types=t[:2] + ["", "", ""])  # no offs
    assert c == (2 * 2 * 8 * 16 * 4, 2 * 8 * 16 * 2 + 2 * 16 * 4 * 2 + 2 * 8 * 4 * 2)


def test_embedding_dense_backward_hand_count():
    # grad [4, 3, 8] for indices [4, 3] into a 10-row table: one add per grad element, read grad
    # and indices, write the dense [10, 8] weight gradient
    c = cost("aten::embedding_dense_backward", [[4, 3, 8], [4, 3], [], [], []],
             ["float32", "int64", "Scalar", "Scalar", "Scalar"], concrete=["", "", "10", "-1", "False"])
    assert c == (96, 96 * F4 + 12 * I8 + 10 * 8 * F4)


@pytest.mark.parametrize("op", ["aten::_scaled_dot_product_flash_attention_backward",
                                "aten::_scaled_dot_product_efficient_attention_backward"])
def test_sdpa_backward_hand_count(op):
    """B=1, H=2, S=4, D=8, bf16, not causal: five S x S x D matmuls (recomputed scores, dV, dP,
    dQ, dK), 2 FLOPs per multiply-add; read q, k, v, out, dout, lse, write dq, dk, dv."""
    B, H, S, D = 1, 2, 4, 8
    q = [B, H, S, D]
    if "flash" in op:  # (grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, p, causal, ...)
        shapes = [q, q, q, q, q, [B, H, S], [], [], [], [], [], [], [], [], []]
        dtypes = ["bfloat16"] * 5 + ["float32", "", "", "Scalar", "Scalar", "Scalar", "Scalar", "int64", "int64", ""]
        concrete = [""] * 8 + [str(S), str(S), "0.", "False", "", "", ""]
    else:  # (grad_out, q, k, v, attn_bias, out, logsumexp, philox_seed, philox_offset, p, grad_input_mask, causal, scale)
        shapes = [q, q, q, q, [], q, [B, H, S], [], [], [], [], [], []]
        dtypes = ["bfloat16"] * 4 + [""] + ["bfloat16", "float32", "int64", "int64", "Scalar", "ScalarList", "Scalar", ""]
        concrete = [""] * 9 + ["0.", "[True, True, True, False]", "False", ""]
    c = cost(op, shapes, dtypes, concrete=concrete, types=[_trace_type(d) for d in dtypes])
    assert c.flops == 5 * 2 * B * H * S * S * D
    qkv, out, lse = 3 * B * H * S * D * 2, B * H * S * D * 2, B * H * S * 4
    assert c.bytes == 2 * qkv + 2 * out + lse


def test_uncosted_ops_get_an_estimate_that_does_not_count():
    """An op without a formula is shown with the generic estimate (inputs + an output the size of
    the largest input) and stays out of coverage."""
    import pandas as pd

    ops = pd.DataFrame({
        "op": ["aten::mm", "aten::some_op_kprof_has_no_formula_for"], "input_shapes": [[[4, 8], [8, 2]], [[4, 8]]],
        "input_dtypes": [["float32", "float32"], ["float32"]], "input_strides": [[[8, 1], [2, 1]], [[8, 1]]],
        "concrete_inputs": [["", ""], [""]], "input_types": [["float", "float"], ["float"]],
        "n_kernels": [0, 0], "op_id": [0, 1], "parent_id": [-1, -1], "device_time (us)": [30.0, 10.0], "step": [0, 0],
    })
    a = costmodel.annotate(ops)
    assert a["cost_known"].tolist() == [True, False]
    assert a["estimated bytes"].isna().tolist() == [True, False]
    assert a["estimated bytes"].iloc[1] == 2 * 4 * 8 * F4
    assert analysis.coverage(a) == pytest.approx(0.75)
    assert analysis.estimated_share(a) == pytest.approx(0.25)
    u = analysis.uncosted(a, n_steps=1)
    assert u["op"].tolist() == ["aten::some_op_kprof_has_no_formula_for"]
    assert u["estimated GB/step"].iloc[0] == pytest.approx(2 * 4 * 8 * F4 / 1e9)

"""The Triton grouped GEMM for MoE experts (kprof.kernels.moe_grouped_gemm): forward and the
grads of x, w_gate_up and w_down against the per-expert loop in fp64 (sums by relative Frobenius
error: see test_matches_reference), with H and I that are not multiples of the blocks,
row tiles straddling experts (16-row tiles under the interpreter), empty experts, all rows on
one expert, zero rows and one expert; HF-layout (transposed, misaligned) weights; rows past the
last offset; argument errors; run-to-run determinism; the custom ops a profiler sees and their
costs; torch.compile (Dynamo here, the triton_op trace and an sm_90 compile in subprocesses,
Inductor on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from kprof.errors import KprofError
from kprof.kernels import moe_grouped_gemm as G
from kprof.kernels.common import assert_close, assert_close_sum
from kprof.kernels.registry import TensorMeta, op_cost
from moe_helpers import check_matches_reference, inputs, reference, run

DTYPES = [torch.float32, torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)]
# (rows per expert, hidden, intermediate); the interpreter's tiles are 16 rows, 16-32 columns
CASES = [
    ((5, 0, 7, 8, 0), 24, 40),  # empty experts; tiles straddle 3 experts; partial K and column tiles
    ((0, 0, 29, 0), 16, 8),  # all rows on one expert (with empty experts on both sides)
    ((), 16, 8),  # zero rows in total (over 3 experts): the weight grads are zeros
    ((21,), 24, 40),  # one expert
    pytest.param((40, 3, 0, 17, 1, 9, 0, 22), 64, 96, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts, h, i", CASES, ids=lambda v: str(v))
def test_matches_reference(counts, h, i, dtype, device):
    # Weight grads per expert by relative Frobenius error (`assert_close_sum`), and in 16 bits dx
    # per row too: each is a sum over intermediates rounded to 16 bits (h, a, dh; the loop rounds
    # them too), and with cancellation that rounding dominates single elements. Elementwise
    # against fp64 with the bf16 entry, in the 8-expert H 64, I 96 case, the eager bf16 loop
    # misses on 442 of 98304 d w_gate_up elements, `_grouped_mm` on 305 and this kernel on 157
    # (fp16: loop 675, kernel 239; fp16 dx: loop 12, kernel 1), while by relative Frobenius
    # error the kernel's weight grads (per expert) and dx (per row) are at most 3.8e-3 and 5.8e-3
    # off in bf16 (rtol 1.6e-2), 5.1e-4 and 7.4e-4 in fp16 (rtol 2e-3), over these cases.
    check_matches_reference(G.moe_grouped_gemm, counts, h, i, dtype, device, dx_by_rows=dtype != torch.float32)


@pytest.mark.gpu
def test_mixtral_layer_matches_reference(device):
    """The issue's Mixtral layer: 8 experts x 512 rows, H 1024, I 2816, bf16, against fp64 (grads
    by relative Frobenius error, as in test_matches_reference)."""
    check_matches_reference(G.moe_grouped_gemm, (512,) * 8, 1024, 2816, torch.bfloat16, device, dx_by_rows=True)


def test_hf_layout_weights(device):
    """Transposed views of HF's stacked [E, 2I, H] and [E, H, I] parameters, H = 13 (52-byte fp32
    rows: strides `_grouped_mm` refuses), and a non-contiguous x and dy: the kernels take any
    strides."""
    x, offs, wgu, wd, dy = inputs((6, 0, 11), 13, 24, torch.float32, device)
    wgu_hf = wgu.transpose(1, 2).contiguous().transpose(1, 2)
    wd_hf = wd.transpose(1, 2).contiguous().transpose(1, 2)
    x_nc = torch.stack([x, x], 2)[..., 0]  # column stride 2
    dy_nc = torch.stack([dy, dy], 2)[..., 1]
    y, grads = run(G.moe_grouped_gemm, x_nc, offs, wgu_hf, wd_hf, dy_nc)
    yr, grads_r = reference(x, offs, wgu, wd, dy)
    assert_close(y, yr, msg="y")
    assert_close(grads[0], grads_r[0], msg="d x")
    for a, b in zip(grads[1:], grads_r[1:]):
        assert_close_sum(a, b)


def test_rows_past_the_last_offset_are_zero(device):
    """x has 3 more rows than the experts own: their outputs are 0 (not uninitialised memory,
    as `_grouped_mm` leaves them)."""
    x, offs, wgu, wd, _ = inputs((4, 5), 16, 8, torch.float32, device)
    x = torch.cat([x, torch.randn(3, 16, device=device)])
    y = G.moe_grouped_gemm(x, offs, wgu, wd)
    assert torch.equal(y[9:], torch.zeros(3, 16, device=device))
    assert_close(y[:9], G.moe_grouped_gemm_reference(x[:9].double(), offs, wgu.double(), wd.double()))


def test_argument_errors(device):
    x, offs, wgu, wd, _ = inputs((3, 4), 16, 8, torch.float32, device)
    with pytest.raises(KprofError, match="disagree"):
        G.moe_grouped_gemm(x, offs, wgu, wd[:, :, :8])
    with pytest.raises(KprofError, match="one device"):
        G.moe_grouped_gemm(x, offs.to("meta"), wgu, wd)  # the kernel would read a pointer of another device


def test_deterministic(device):
    """No atomics: two runs agree bit for bit (KernelSpec.deterministic)."""
    args = inputs((5, 0, 7, 8, 0), 16, 8, torch.bfloat16, device)
    (y1, g1), (y2, g2) = run(G.moe_grouped_gemm, *args), run(G.moe_grouped_gemm, *args)
    for a, b in zip((y1, *g1), (y2, *g2)):
        assert torch.equal(a, b)


def test_profiler_sees_the_custom_ops_with_costs(device):
    """While a profiler records, forward and backward run as kprof::moe_grouped_gemm_{fwd,bwd}
    (same results as the eager path), and the registry costs them from their input shapes."""
    args = inputs((5, 0, 7), 24, 40, torch.float32, device)
    y, grads = run(G.moe_grouped_gemm, *args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        y_p, grads_p = run(G.moe_grouped_gemm, *args)
    for a, b in zip((y, *grads), (y_p, *grads_p)):
        assert torch.equal(a, b)
    events = {e.name: e for e in prof.events()}
    expected = G._cost(12, 24, 40, 3, torch.float32)
    for d in ("fwd", "bwd"):
        ev = events[f"kprof::moe_grouped_gemm_{d}"]
        metas = [TensorMeta(tuple(s), torch.float32) for s in ev.input_shapes]  # the cost reads x's dtype only
        assert op_cost(ev.name, metas) == expected[d]


def test_fullgraph_captures_the_ops(device):
    """torch.compile(fullgraph=True) keeps the call whole: one graph, the forward and backward
    bodies call kprof::moe_grouped_gemm_{fwd,bwd}, and the results are the eager ones bit for bit
    (the same kernels run). As tests/kernels/test_compile.py does for the other kernels."""
    from test_compile import _kprof_ops, _run

    x, offs, wgu, wd, _ = inputs((5, 0, 7), 16, 8, torch.bfloat16, device)

    def call(x, wgu, wd, offs):
        return G.moe_grouped_gemm(x, offs, wgu, wd)

    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = _run(torch.compile(call, backend=capture, fullgraph=True), [x, wgu, wd], [offs])
    assert len(graphs) == 1
    assert _kprof_ops(graphs[0], "fwd_body") == {"moe_grouped_gemm_fwd"}
    assert _kprof_ops(graphs[0], "bwd_body") == {"moe_grouped_gemm_bwd"}
    for a, b in zip(got, _run(call, [x, wgu, wd], [offs])):
        assert torch.equal(a, b)


# Each op as AOTAutograd traces it on a GPU (FunctionalTensorMode over fake CUDA tensors, Triton
# not interpreted): a torch.library.triton_op whose body becomes launches of this module's
# kernels (which Inductor then launches itself), nothing opaque.
TRACE_SCRIPT = r"""
import torch
torch.cuda.current_device = lambda: 0
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from kprof.kernels import moe_grouped_gemm  # noqa: F401  (registers the ops)
K = torch.ops.kprof
fm = FakeTensorMode()
with fm:
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, wgu, wd, h = torch.randn(12, 16, **bf), torch.randn(3, 16, 48, **bf), torch.randn(3, 24, 16, **bf), torch.randn(12, 48, **bf)
    offs = torch.tensor([5, 5, 12], dtype=torch.int32, device="cuda")
for name, op, args in (("fwd", K.moe_grouped_gemm_fwd, (x, offs, wgu, wd)),
                       ("bwd", K.moe_grouped_gemm_bwd, (x, x, offs, h, wgu, wd))):
    with fm:
        gm = make_fx(dispatch_functionalize(op))(*args)
    nodes = [str(n.target) for n in gm.graph.nodes]
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
               for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    print(name, ",".join(kernels), sum("kprof" in t for t in nodes))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below compiles them with Inductor")
def test_ops_are_triton_ops_that_trace_into_their_kernels():
    from aot_helpers import run_aot_script

    got = run_aot_script(TRACE_SCRIPT).split()
    assert got == ["fwd", "_rows_kernel,_rows_kernel", "0",
                   "bwd", "_rows_kernel,_rows_kernel,_weights_kernel,_weights_kernel", "0"]


@pytest.mark.gpu
def test_inductor_fullgraph_launches_the_kernels():
    """Inductor launches the kernels from its generated code (no call back into a kprof:: op).
    y is the eager one bit for bit (the same kernel); the grads start from `_run`'s sin loss,
    which Inductor fuses differently, so they are compared by relative Frobenius error."""
    from test_compile import _run
    from torch._inductor.utils import run_and_get_code

    x, offs, wgu, wd, _ = inputs((300, 0, 212), 256, 384, torch.bfloat16, "cuda")

    def call(x, wgu, wd, offs):
        return G.moe_grouped_gemm(x, offs, wgu, wd)

    torch._dynamo.reset()
    compiled = torch.compile(call, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(lambda: _run(compiled, [x, wgu, wd], [offs]))
    want = _run(call, [x, wgu, wd], [offs])
    assert torch.equal(got[0], want[0])
    for name, a, b in zip(("x", "w_gate_up", "w_down"), got[1:], want[1:]):
        assert_close_sum(a, b, msg=f"d {name}")  # per row of dx, per expert of the weights
    code = "\n".join(codes)
    assert "_rows_kernel" in code and "_weights_kernel" in code and "torch.ops.kprof" not in code

# The interpreter accepts code the compiler rejects and shows neither register pressure nor
# pipelining, so the kernels are also compiled for sm_90 here (no GPU: Triton's own ptxas), in a
# subprocess without TRITON_INTERPRET, at `_config`'s GPU tiles and with the specialisations a
# launch at the Mixtral shape gets (16-divisible pointers, sizes and strides; unit strides as
# constants). Each of the six launches must use wgmma, multi-buffer its loads (cp.async) and
# not spill (ptxas -v).
AOT_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from kprof.errors import KprofError
from kprof.kernels import moe_grouped_gemm as G
from kprof.kernels.common import assert_close, assert_close_sum

# (kernel, epilogue or GATED, the strides that are 1), as _fwd and _bwd launch them
LAUNCHES = [("_rows_kernel", 1, ("s_ak", "s_bn")), ("_rows_kernel", 0, ("s_ak", "s_bn")),
            ("_rows_kernel", 2, ("s_ak", "s_bk")), ("_rows_kernel", 0, ("s_ak", "s_bk")),
            ("_weights_kernel", False, ("s_ak", "s_bn")), ("_weights_kernel", True, ("s_ak", "s_bn"))]
for name, mode, ones in LAUNCHES:
    fn = getattr(G, name)
    if name == "_rows_kernel":
        bm, bn, bk, warps, stages = G._config(torch.bfloat16, mode != 0)
        consts = dict(EPI=mode, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=8)
    else:
        bm, bn, bk, warps, stages = G._config(torch.bfloat16, False)
        consts = dict(GATED=mode, BLOCK_K=bm, BLOCK_N=bn, BLOCK_R=bk)
    consts.update(INTERP=False, FAST=True, **{a: 1 for a in ones})
    sig, attrs = {}, {}
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        sig[a] = "*i32" if a == "offs_ptr" else "*bf16" if a.endswith("_ptr") else "i32"
        if a != "n_experts":
            attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": True})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    ir = k.asm["ttgir"]
    print(name, mode, "wgmma" if "warp_group_dot" in ir else "-", "cp.async" if "async_copy_global_to_local" in ir else "-",
          re.search(r"(\d+) bytes spill stores", log).group(1))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90_pipelined_without_spills():
    pytest.importorskip("triton.backends.nvidia")
    from aot_helpers import run_aot_script

    lines = [ln.split() for ln in run_aot_script(AOT_SCRIPT).splitlines() if ln.startswith("_")]
    assert len(lines) == 6, lines
    for name, mode, wgmma, cp_async, spill in lines:
        assert (wgmma, cp_async, spill) == ("wgmma", "cp.async", "0"), (name, mode)

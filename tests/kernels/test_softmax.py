"""kprof.kernels.softmax against its reference (and against the eager attention pattern).

Shapes cross the kernel's regimes: one tiny row (1x1), many short rows packed per program
(3x7, 37x781), rows just inside the in-register limit (32768) and just past it (32769, the
looped online-softmax path), and one 65536-wide row. The 1823x781 case is GPU-only (the
Triton interpreter would take minutes); 37x781 stands in for it on the CPU.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import KprofError
from kprof.kernels import registry
from kprof.kernels.common import assert_close
from kprof.kernels.softmax import MAX_FUSED_COLS, SPEC, Softmax, softmax, softmax_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp16 where fp32 and bf16 already cover the code path: slow (docs/testing.md)
DTYPE_CASES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # for hypothesis tests (no fixtures there)
gpu = pytest.mark.gpu

SHAPES = [
    (1, 1),
    (3, 7),
    (37, 781),
    (2, 5, 4097),
    (1, MAX_FUSED_COLS),  # widest in-register row
    (2, MAX_FUSED_COLS + 1),  # narrowest looped row
    (1, 65536),
    pytest.param((1823, 781), marks=gpu),
    pytest.param((64, 8192), marks=gpu),
    pytest.param((4, 2, 3, 131072), marks=gpu),
]


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """The reference runs in fp64 for fp32 inputs, fp32 for half inputs."""
    return t.to(torch.float64 if t.dtype == torch.float32 else torch.float32)


def _check(x: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of the kernel vs the upcast reference; returns (y, dx)."""
    x = x.detach().requires_grad_()  # keeps x's strides
    y = softmax(x, **kw)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = _upcast(x.detach()).requires_grad_()
    yr = softmax_reference(xr, **kw)
    yr.backward(_upcast(dy))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert_close(y, yr, x.dtype, msg="forward")
    assert_close(x.grad, xr.grad, x.dtype, msg="backward")
    return y, x.grad


def _randn(shape, dtype, device, gen_scale=3.0):
    # A spread of 3 makes rows peaky enough that max-subtraction and rounding matter.
    return (torch.randn(shape, device=device) * gen_scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, device):
    torch.manual_seed(0)
    _check(_randn(shape, dtype, device), scale=0.37)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("view", ["transposed", "strided_cols", "column_slice", "expanded"])
def test_non_contiguous(view, dtype, device):
    torch.manual_seed(1)
    if view == "transposed":
        x = _randn((781, 37), dtype, device).t()  # [37, 781], column stride 37
    elif view == "strided_cols":
        x = _randn((3, 5, 2 * 301), dtype, device)[..., ::2]
    elif view == "column_slice":
        x = _randn((9, 1000), dtype, device)[:, 3:784]  # unit column stride, row stride 1000: no copy
    else:
        x = _randn((1, 129), dtype, device).expand(4, 129)  # row stride 0
    assert not x.is_contiguous()
    _check(x, scale=1.3)


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (2, 0, 5)])
def test_empty(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = softmax(x, causal=len(shape) > 1)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


MASK_SHAPES = [
    (5, 9),  # [L, S] shared by batch and heads
    (2, 1, 5, 9),  # per batch, broadcast over heads
    (2, 1, 1, 9),  # key padding mask
    (9,),
    (2, 3, 5, 1),  # whole rows on/off
]


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_mask_and_causal(mask_shape, causal, dtype, device):
    torch.manual_seed(2)
    x = _randn((2, 3, 5, 9), dtype, device)
    mask = torch.rand(mask_shape, device=device) > 0.3
    _check(x, scale=0.125, mask=mask, causal=causal)


@pytest.mark.parametrize("q_len,k_len", [(7, 7), (4, 11), (11, 4)])
def test_causal_is_top_left(q_len, k_len, device):
    """Causal keeps exactly torch.tril(ones(L, S)), SDPA's is_causal alignment."""
    x = torch.randn(2, q_len, k_len, device=device)
    y = softmax(x, causal=True)
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    assert torch.all(y[:, ~keep] == 0)
    assert torch.all(y[:, keep] > 0)
    expected = torch.softmax(x.double().masked_fill(~keep, float("-inf")), dim=-1)
    assert_close(y, expected, torch.float32)


@pytest.mark.parametrize("shape", [(2, 40, 70), (1, 3, 37, 33), (1, 20, MAX_FUSED_COLS + 40)])
def test_causal_reads_stop_at_diagonal(shape, device):
    """Causal reads stop at the diagonal rounded up to 16 columns (in-register and looped paths,
    forward and backward); what lies past it (here NaN in x) changes nothing, as in eager."""
    torch.manual_seed(11)
    x = _randn(shape, torch.float32, device)
    q_len, k_len = shape[-2], shape[-1]
    past = ~torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
    y, _ = _check(x.masked_fill(past, float("nan")), scale=0.6, causal=True)
    assert torch.all(y[..., past] == 0)


def test_mask_needing_materialization(device):
    """A 5-D mask whose broadcast strides do not collapse to three leading dims."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 4, 5, 6, device=device)
    mask = torch.rand(2, 1, 4, 1, 6, device=device) > 0.4
    _check(x, mask=mask)


def test_mask_non_contiguous(device):
    torch.manual_seed(4)
    x = torch.randn(3, 8, 10, device=device)
    mask = (torch.rand(10, 8, device=device) > 0.5).t()  # [8, 10], transposed storage
    _check(x, mask=mask, causal=True)


@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_matches_eager_attention_pattern(dtype, device):
    """The pattern users write: scores * scale, masked_fill(mask == 0, -inf), softmax."""
    torch.manual_seed(5)
    scores = _randn((2, 4, 16, 16), dtype, device)
    mask = (torch.rand(2, 1, 16, 16, device=device) > 0.2).int()
    mask[..., 0] = 1  # no fully masked row here (see test_fully_masked_rows)
    y = softmax(scores, scale=0.25, mask=mask != 0)
    eager = torch.softmax((_upcast(scores) * 0.25).masked_fill(mask == 0, float("-inf")), dim=-1)
    assert_close(y, eager, dtype)


@pytest.mark.parametrize("cols", [9, MAX_FUSED_COLS + 5])  # in-register and looped paths
def test_fully_masked_rows(cols, device):
    """Fully masked rows give zeros and zero grads (eager gives NaN); other rows match eager."""
    torch.manual_seed(6)
    x = torch.randn(4, cols, device=device, requires_grad=True)
    mask = torch.rand(4, cols, device=device) > 0.5
    mask[1] = False
    y = softmax(x, mask=mask)
    eager = torch.softmax(x.detach().double().masked_fill(~mask, float("-inf")), dim=-1)
    assert torch.isnan(eager[1]).all()  # what eager does
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    keep_rows = [0, 2, 3]
    assert_close(y[keep_rows], eager[keep_rows], torch.float32)
    y.backward(torch.randn_like(y))
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[1], torch.zeros_like(x.grad[1]))
    # A row whose kept logits are all -inf is fully masked too.
    x2 = torch.full((2, cols), float("-inf"), device=device)
    x2[0, 0] = 1.0
    y2 = softmax(x2)
    assert y2[0, 0] == 1 and torch.equal(y2[1], torch.zeros_like(y2[1]))


def test_fully_masked_everything_causal(device):
    """Causal with an all-False mask: every row dead, output all zeros, no NaN."""
    x = torch.randn(2, 3, 3, device=device)
    y = softmax(x, mask=torch.zeros(3, dtype=torch.bool, device=device), causal=True)
    assert torch.equal(y, torch.zeros_like(y))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 300),
    scale=st.floats(0.01, 4.0),
    keep_p=st.floats(0.0, 1.0),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_rows_sum_to_one_and_match(rows, cols, scale, keep_p, causal, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, rows, cols, generator=g) * 5).to(DEVICE)
    mask = (torch.rand(2, 1, cols, generator=g) < keep_p).to(DEVICE)
    y, _ = _check(x, scale=scale, mask=mask, causal=causal)
    keep = mask.expand(x.shape)
    if causal:
        keep = keep & torch.ones(rows, cols, dtype=torch.bool, device=DEVICE).tril()
    live = keep.any(-1)
    sums = y.double().sum(-1)
    torch.testing.assert_close(sums[live], torch.ones_like(sums[live]), atol=1e-5, rtol=0)
    assert torch.all(sums[~live] == 0)
    # Shift invariance: adding a per-row constant changes nothing (up to fp32 rounding).
    y_shift = softmax(x + 7.5 / scale, scale=scale, mask=mask, causal=causal)
    assert_close(y_shift, y, torch.float32)


@pytest.mark.parametrize("cols", [781, pytest.param(MAX_FUSED_COLS + 5, marks=pytest.mark.slow)])  # looped: slow
def test_deterministic(cols, device):
    torch.manual_seed(7)
    x = torch.randn(3, cols, device=device, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.rand(cols, device=device) > 0.1
    dy = torch.randn(3, cols, device=device, dtype=torch.bfloat16)
    outs = []
    for _ in range(2):
        x.grad = None
        y = softmax(x, scale=0.3, mask=mask)
        y.backward(dy)
        outs.append((y.detach().clone(), x.grad.clone()))
    assert SPEC.deterministic
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_torch_compile_no_graph_break(device):
    torch.manual_seed(8)
    x = torch.randn(2, 3, 6, 10, device=device, requires_grad=True)
    mask = torch.rand(2, 1, 6, 10, device=device) > 0.3

    def attn_probs(scores, m):
        return softmax(scores, scale=0.5, mask=m, causal=True) * 2.0

    compiled = torch.compile(attn_probs, backend="aot_eager", fullgraph=True)
    y = compiled(x, mask)
    y.sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    y_eager = attn_probs(x, mask)
    y_eager.sum().backward()
    assert_close(y, y_eager)
    assert_close(grad_compiled, x.grad)


def test_module(device):
    torch.manual_seed(9)
    x = torch.randn(2, 4, 4, device=device)
    m = Softmax(scale=0.5, causal=True)
    assert "causal=True" in repr(m)
    assert_close(m(x), softmax_reference(x.double(), scale=0.5, causal=True), torch.float32)


def test_fallback_without_triton(monkeypatch):
    """CPU without the interpreter: warns once and runs the reference."""
    from kprof.kernels import common as _common

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_common, "_warned", set())
    x = torch.randn(3, 5)
    with pytest.warns(UserWarning, match="softmax.*reference"):
        y = softmax(x, scale=2.0, causal=True)
    assert torch.equal(y, softmax_reference(x, scale=2.0, causal=True))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: dict(x=torch.ones(3, 4, dtype=torch.int32, device=d)), "dtype torch.int32"),
        (lambda d: dict(x=torch.ones(3, 4, dtype=torch.float64, device=d)), "dtype torch.float64"),
        (lambda d: dict(x=torch.tensor(1.0, device=d)), "0-d"),
        (lambda d: dict(x=torch.ones(4, device=d), causal=True), "causal=True needs"),
        (lambda d: dict(x=torch.ones(3, 4, device=d), mask=torch.ones(3, 4, device=d)), "boolean keep-mask"),
        (lambda d: dict(x=torch.ones(3, 4, device=d), mask=torch.ones(2, 4, dtype=torch.bool, device=d)),
         "does not broadcast"),
        (lambda d: dict(x=torch.ones(3, 4, device=d), mask=torch.ones(5, 3, 4, dtype=torch.bool, device=d)),
         "does not broadcast"),
    ],
)
def test_bad_input(make, match, device):
    with pytest.raises(KprofError, match=match):
        softmax(**make(device))


def test_cost_model():
    c = SPEC.cost(n_rows=16384, n_cols=8192, dtype=torch.bfloat16)
    n = 16384 * 8192
    assert c["fwd"].bytes == 2 * n * 2  # read x, write y
    assert c["bwd"].bytes == 3 * n * 2  # read y, dy, write dx
    assert c["fwd"].flops == 6 * n and c["bwd"].flops == 5 * n
    x = registry.TensorMeta((4, 16, 128, 256), torch.float16)
    mask = registry.TensorMeta((4, 1, 128, 256), torch.bool)
    fwd = registry.op_cost("kprof::softmax_fwd", [x, mask])
    assert fwd.bytes == 2 * 4 * 16 * 128 * 256 * 2 + 4 * 128 * 256
    assert registry.op_cost("kprof::softmax_fwd", [x]).bytes == 2 * 4 * 16 * 128 * 256 * 2
    assert registry.op_cost("kprof::softmax_bwd", [x, x]).bytes == 3 * 4 * 16 * 128 * 256 * 2
    assert registry.get("softmax") is SPEC


def test_expanded_grad(device):
    """`.sum().backward()` hands the backward a stride-0 dy; the result is ~0 (rows sum to 1)."""
    x = torch.randn(5, 33, device=device, requires_grad=True)
    (softmax(x, scale=2.0) * 3.0).sum().backward()  # dy = 3 everywhere: dx = 3 * 2 * y * (1 - 1)
    g1 = x.grad.clone()
    x.grad = None
    softmax(x, scale=2.0).sum().backward()
    assert_close(g1, torch.zeros_like(g1))
    assert_close(x.grad, torch.zeros_like(x.grad))


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op dispatched below autograd (aten ops, kprof custom ops)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _LaunchLog:
    """Stands in for a Triton kernel: records launches instead of running them (so the op log
    holds only the launcher's own ops, not the CPU interpreter's argument copies)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(self.name)


def test_eager_path_launches_directly(monkeypatch, device):
    """Eager fwd+bwd: no custom op, one launch each way, and the only tensor ops are the two
    output allocations (plus autograd's detach of the saved y). Each avoided op is ~12 us of host
    time on the H200 machine, where this path was host-bound (kernels/common.py::via_custom_op)."""
    from kprof.kernels import softmax as mod

    launches: list[str] = []
    for name in ("_softmax_fwd_rows_kernel", "_softmax_bwd_rows_kernel"):
        monkeypatch.setattr(mod, name, _LaunchLog(name, launches))
    x = torch.randn(4, 2, 8, 16, device=device, requires_grad=True)
    mask = torch.rand(4, 1, 1, 16, device=device) > 0.2
    dy = torch.randn(4, 2, 8, 16, device=device)
    with _OpLog() as log:
        y = softmax(x, scale=0.5, mask=mask, causal=True)
        y.backward(dy)
    assert launches == ["_softmax_fwd_rows_kernel", "_softmax_bwd_rows_kernel"]
    # (autograd's own detach of saved tensors is left out: its count is torch's business)
    assert [op for op in log.ops if op != "aten.detach.default"] == ["aten.empty_like.default"] * 2, log.ops


def test_profiler_sees_custom_ops(device):
    """While a profiler records, the calls go through kprof::softmax_fwd/_bwd (the cost model
    reads their shapes from the trace); results equal the eager path's."""
    torch.manual_seed(10)
    x = torch.randn(3, 5, 40, device=device, requires_grad=True)
    mask = torch.rand(5, 40, device=device) > 0.3
    y_eager = softmax(x, scale=0.7, mask=mask, causal=True)
    with torch.profiler.profile() as prof:
        y = softmax(x, scale=0.7, mask=mask, causal=True)
        y.backward(torch.ones_like(y))
    names = {e.name for e in prof.events()}
    assert {"kprof::softmax_fwd", "kprof::softmax_bwd"} <= names
    assert torch.equal(y, y_eager)


@pytest.mark.parametrize("with_mask", [False, True])
def test_custom_ops_opcheck(with_mask, device):
    from kprof.kernels.softmax import softmax_bwd_op, softmax_fwd_op

    x = torch.randn(2, 3, 6, 10, device=device)
    mask = (torch.rand(2, 1, 1, 10, device=device) > 0.3) if with_mask else None
    torch.library.opcheck(softmax_fwd_op, (x, mask, 0.5, True))
    y = softmax_fwd_op(x, mask, 0.5, True)
    torch.library.opcheck(softmax_bwd_op, (y, torch.randn_like(y), 0.5, True))


# The interpreter accepts code the compiler rejects and shows no memory instructions, so CPU CI
# also compiles the kernels for sm_90 ahead of time (in a subprocess without TRITON_INTERPRET;
# ptxas ships with Triton) and checks their global memory accesses are 16-byte vectors.
AOT_SCRIPT = r"""
import os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kprof.kernels import softmax

for name, consts, warps in eval(sys.argv[1]):
    fn = getattr(softmax, name)
    sig = {a: "constexpr" if a in consts else "*i1" if a == "mask_ptr" else "*bf16" if a.endswith("_ptr")
           else "fp32" if a == "scale" else "i32" for a in fn.arg_names}
    # Pointers, widths, row strides, mask strides and q_len of the benchmark shapes are multiples
    # of 16 (as the launcher specializes them); the mask's column stride is 1 (specialized away).
    div16 = [i for i, a in enumerate(fn.arg_names) if a not in consts and sig[a] != "fp32"
             and a not in ("n_rows", "m_size1", "m_size2")]
    src = ASTSource(fn, sig, consts, {(i,): [["tt.divisibility", 16]] for i in div16})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    print("compiled", name, consts, sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90_with_vector_accesses():
    pytest.importorskip("triton.backends.nvidia")
    import os
    import subprocess
    import sys

    from kprof.kernels.softmax import SoftmaxConfig

    variants = []
    for cols in (8192, 1024, MAX_FUSED_COLS + 1):  # the two benchmark widths, and the looped path
        c = SoftmaxConfig.for_cols(cols)
        rows = {} if c.looped else {"ROWS": c.rows, "IDX64": cols == 1024}  # int64 row indices once
        kind = "looped" if c.looped else "rows"
        for has_mask, causal in ((False, False), (True, True)):
            variants.append((f"_softmax_fwd_{kind}_kernel", dict(
                rows, BLOCK_N=c.block_n, HAS_MASK=has_mask, CAUSAL=causal, m_stride_col=1), c.num_warps))
            variants.append((f"_softmax_bwd_{kind}_kernel", dict(rows, BLOCK_N=c.block_n, CAUSAL=causal), c.num_warps))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT, repr(variants)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("compiled")]
    assert len(lines) == len(variants)
    for ln in lines:
        # Every access a 16-byte vector (8 bf16 or 16 mask bytes): the causal read limit is rounded
        # to 16 columns so it keeps that; a scalar (b8, b16) or narrower access means it was lost.
        assert "ld.global.v4.b32" in ln and "st.global.v4.b32" in ln, ln
        assert not any(f"global.{w}'" in ln for w in ("b8", "b16", "b32", "v2.b32")), ln

"""kprof.kernels.layer_norm against its reference (F.layer_norm upcast) and nn.LayerNorm.

Shapes cross the kernel's regimes as in test_rms_norm: tiny rows, many short rows per block
(300x64), odd widths (781, 4097), the looped path (one 65536-wide row, and a shrunk
in-register limit at small sizes). 1823x781 and the benchmark shape are GPU-only; 37x781
stands in on the CPU (Triton interpreter).
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kprof.errors import KprofError
from kprof.kernels import common
from kprof.kernels import layer_norm as layer_norm_module
from kprof.kernels import registry
from kprof.kernels import rms_norm as rms_norm_module  # owns the shared RowConfig limits
from kprof.kernels.common import assert_close
from kprof.kernels.layer_norm import SPEC, LayerNorm, layer_norm, layer_norm_reference
from kprof.kernels.rms_norm import MAX_FUSED_N

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp16 where fp32 and bf16 already cover the code path: slow (docs/testing.md)
DTYPE_CASES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.slow), torch.bfloat16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # for hypothesis tests (no fixtures there)
gpu = pytest.mark.gpu
AFFINE = ["weight+bias", "weight", "bias", "none"]

# The same row-shape sweep as RMSNorm: both kernels share RowConfig, so the regime boundaries
# (in-register vs looped, MAX_FUSED_N) are the same.
from test_rms_norm import SHAPES  # noqa: E402


def _upcast(t):
    """The reference runs in fp64 for every input dtype. (fp32 is not enough for half inputs
    at N = 1: x - mean is exactly 0 but torch's fp32 layer_norm leaves a rounding residue that
    rstd = 1/sqrt(eps) amplifies, e.g. dweight 0.011 instead of 0 at |x| ~ 200, fp16.)"""
    if t is None:
        return None
    return t.to(torch.float64)


def _inputs(shape, dtype, device, affine="weight+bias", p_dtype=None, seed=0, mean=0.5):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 2.0 + mean).to(device=device, dtype=dtype)
    w = (torch.randn(n, generator=g) * 0.2 + 1.0).to(device=device, dtype=p_dtype or dtype)
    b = (torch.randn(n, generator=g) * 0.2).to(device=device, dtype=p_dtype or dtype)
    return x, (w if "weight" in affine else None), (b if "bias" in affine else None)


def _check(x, w, b, eps=1e-5, dy_scale=1.0):
    """Forward and backward (dx, dweight, dbias) of the kernel vs the upcast reference.

    dy is seeded (reproducible failures) and scaled by `dy_scale`: dx scales like dy / std(x),
    so a test that shrinks x shrinks dy with it to keep dx O(1), where the table's absolute
    tolerance is meaningful (an O(100) gradient carries fp32 rounding of ~1e-5 absolute)."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    x, w, b = leaves
    y = layer_norm(x, w, b, eps)
    g = torch.Generator().manual_seed(1234)
    dy = (torch.randn(y.shape, generator=g) * dy_scale).to(device=y.device, dtype=y.dtype)
    y.backward(dy)
    refs = [_upcast(t.detach()).requires_grad_() if t is not None else None for t in leaves]
    yr = layer_norm_reference(*refs, eps)
    yr.backward(_upcast(dy))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, yr, x.dtype, msg="forward")
    n_rows = x.numel() // max(1, x.shape[-1])
    for name, t, r in zip(("dx", "dweight", "dbias"), leaves, refs):
        if t is not None:
            assert t.grad.dtype == t.dtype
            if name == "dweight" and x.dtype == torch.float32 and n_rows > FP32_DW_REF_ROWS:
                continue  # checked against the exact sum of the kernel's terms below
            # Accuracy is bounded by the activations' dtype.
            assert_close(t.grad, r.grad, x.dtype, msg=name)
    if w is not None and x.dtype == torch.float32 and w.dtype == torch.float32:
        # The kernel sums its fp32 terms dy * x_hat in fp64 and rounds once: check that against
        # the same terms from its own mean and rstd, summed in fp64 (isolates the reduction).
        _, stats = torch.ops.kprof.layer_norm_fwd(x.detach(), w.detach(), None, eps)
        terms = dy.reshape(n_rows, -1) * _kernel_x_hat(x.detach(), stats)
        assert_close(w.grad, terms.double().sum(0), msg="dweight vs the exact sum of its terms")
    return y


def _kernel_x_hat(x, stats):
    """x_hat as the backward computes it from the saved stats (mean hi, mean lo, rstd), in fp32:
    (x - hi - lo) * rstd, the same operations in the same order (so the same fp32 values)."""
    n_rows = stats[0].numel()
    x2 = x.reshape(n_rows, -1)
    hi, lo, rstd = (t.reshape(n_rows, 1) for t in stats)
    return (x2 - hi - lo) * rstd


# fp32 dweight against the fp64 reference only up to this many rows. Past it, the fp32 terms
# alone (x_hat and dy * x_hat, correctly rounded, with fp32 mean and rstd, summed exactly) use
# 1.43x the fp32 tolerance on near-zero columns at 16384x4096 (seed 0; eager fp32 PyTorch on the
# CPU: 14x); 0.45 at 1823x781 (measured on the CPU). Larger shapes are covered by dx
# against the reference elementwise and dweight against the exact sum of the kernel's own terms.
# dbias sums the exact dy values in fp64, so it is checked against the reference at every size.
# Same reasoning as test_bias_gelu's dbias.
FP32_DW_REF_ROWS = 2048


@pytest.mark.parametrize("affine", AFFINE[:2])
@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, affine, device):
    _check(*_inputs(shape, dtype, device, affine))


@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("shape", [(3, 7), (37, 781), pytest.param((1823, 781), marks=gpu)])
def test_affine_variants(shape, dtype, affine, device):
    """With and without weight and bias, including F.layer_norm's bias-without-weight."""
    _check(*_inputs(shape, dtype, device, affine, seed=1))


@pytest.mark.slow
def test_fp32_dweight_on_the_h200_grid(monkeypatch, device):
    """16384x4096 fp32 failed dweight on the H200 with fp32 partial sums. Its grid
    is too big for the interpreter; 1823x781 on the H200's grid (228 programs of 8 rows) runs
    the same fp64 partials here: dweight equals the exact sum of the kernel's own fp32 terms
    (in _check), and dweight and dbias match the fp64 reference."""
    from test_rms_norm import H200_SM_COUNT

    monkeypatch.setattr(common, "sm_count", lambda device: H200_SM_COUNT)
    assert rms_norm_module.backward_grid(1823, _bwd_config(781), torch.device(device)) == (228, 8)
    _check(*_inputs((1823, 781), torch.float32, device))


# Weight only and bias only are slow here: the looped path's affine code is shared by all four. So is
# bf16: the looped path casts tile by tile as the in-register path does, whose bf16 cases stay.
@pytest.mark.parametrize("affine", [a if a in ("weight+bias", "none") else pytest.param(a, marks=pytest.mark.slow) for a in AFFINE])
@pytest.mark.parametrize("dtype", [torch.float32] + [pytest.param(d, marks=pytest.mark.slow) for d in (torch.float16, torch.bfloat16)])
def test_looped_path_small(dtype, affine, monkeypatch, device):
    """The looped (wide-row) path at interpreter-friendly sizes: shrink the in-register limit
    so 11 x 150 rows take 5 column tiles (the last one partial) and the 8 CPU programs get
    one or two rows each."""
    monkeypatch.setattr(rms_norm_module, "MAX_FUSED_N", 64)
    monkeypatch.setattr(rms_norm_module, "LOOP_BLOCK_N", 32)
    assert rms_norm_module.RowConfig.backward(150).loop
    _check(*_inputs((11, 150), dtype, device, affine, seed=2))


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_mixed_param_dtype(x_dtype, p_dtype, device):
    """fp32 parameters with half activations (autocast keeps LayerNorm params in fp32): the
    output keeps x's dtype, the grads their parameters' dtypes."""
    _check(*_inputs((37, 129), x_dtype, device, p_dtype=p_dtype, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mean", [1e3, pytest.param(-3e2, marks=pytest.mark.slow)])
def test_large_mean(mean, dtype, device):
    """|mean| >> std: a one-pass E[x²] - E[x]² variance would lose every digit in fp32 here,
    and a plain two-pass one ~6e-5 (torch's own fp32 layer_norm is off by 3.4e-5 at mean
    1000); the corrected two-pass stays within the fp32 tolerance (in-register and looped)."""
    _check(*_inputs((9, 300), dtype, device, seed=4, mean=mean))
    _check(*_inputs((1, 65536), dtype, device, seed=4, mean=mean))


@pytest.mark.parametrize("shape", [(9, 300), (37, 781), (1, 65536)], ids=["rows", "odd", "looped"])
@pytest.mark.parametrize("mean", [1e3, -3e2, 0.5])
def test_saved_mean_pair(shape, mean, device):
    """The forward saves the mean as an fp32 pair: hi is the rounded mean (what was saved
    before) and lo the rest, so hi + lo is the forward's mean0 + corr exactly. Against the
    fp64 mean: the pair is within 1e-7 of a std (measured on the CPU: <= 1.3e-8, and
    ~1e-12 at |mean| 1000), where hi alone is off by up to ulp(hi) / 2 (1.6e-5 of a std at mean
    1000, seed 4) - the error the backward's third row sum used to re-center away."""
    x, _, _ = _inputs(shape, torch.float32, device, seed=4, mean=mean)
    _, stats = torch.ops.kprof.layer_norm_fwd(x, None, None, 1e-5)
    assert stats.shape == (3, shape[0]) and stats.dtype == torch.float32  # mean hi, mean lo, rstd
    hi, lo, _ = stats.double()
    assert torch.equal((hi + lo).float(), stats[0])  # |lo| <= ulp(hi) / 2: hi is the pair rounded
    ref, std = x.double().mean(-1), x.double().std(-1, unbiased=False)
    assert ((hi + lo - ref).abs() / std).max() <= 1e-7
    if abs(mean) >= 300 and shape[0] > 1:
        assert ((hi - ref).abs() / std).max() > 1e-6  # lo carries what the fp32 mean cannot
    y = layer_norm(x, None, None, 1e-5)  # and the output saw the same mean
    assert_close(y, layer_norm_reference(x.double(), None, None, 1e-5))


def _grads(x, w, b):
    """(y, dx, dweight, dbias) of layer_norm with a fixed dy."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = layer_norm(*leaves)
    g = torch.Generator().manual_seed(99)
    y.backward(torch.randn(y.shape, generator=g).to(device=y.device, dtype=y.dtype))
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def test_matches_nn_layer_norm_module(device):
    """Drop-in for nn.LayerNorm: state dicts load both ways, outputs and grads agree."""
    for kwargs in (dict(), dict(bias=False), dict(elementwise_affine=False)):
        ref = torch.nn.LayerNorm(96, eps=1e-6, device=device, **kwargs)
        if kwargs.get("elementwise_affine", True):
            with torch.no_grad():
                ref.weight.normal_(1.0, 0.2)
                if ref.bias is not None:
                    ref.bias.normal_(0.0, 0.2)
        ours = LayerNorm(96, eps=1e-6, device=device, **kwargs)
        ours.load_state_dict(ref.state_dict())
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert isinstance(ours, torch.nn.LayerNorm)
        x = torch.randn(4, 7, 96, device=device)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn_like(x)
        y_ref, y = ref(x1), ours(x2)
        y_ref.backward(dy)
        y.backward(dy)
        assert_close(y, y_ref)
        assert_close(x2.grad, x1.grad)
        for p, q in zip(ours.parameters(), ref.parameters()):
            assert_close(p.grad / 28, q.grad / 28)  # sums over 28 rows


@pytest.mark.parametrize("dtype", DTYPE_CASES)
@pytest.mark.parametrize("view", ["transposed", "strided_cols", "column_slice", "expanded"])
def test_non_contiguous(view, dtype, device):
    if view == "transposed":
        x = torch.randn(781, 37, device=device).to(dtype).t()  # [37, 781], column stride 37
    elif view == "strided_cols":
        x = torch.randn(3, 5, 2 * 301, device=device).to(dtype)[..., ::2]
    elif view == "column_slice":
        x = torch.randn(9, 1000, device=device).to(dtype)[:, 3:784]  # row stride 1000, no copy
    else:
        x = torch.randn(1, 129, device=device).to(dtype).expand(4, 129)  # row stride 0
    assert not x.is_contiguous()
    n = x.shape[-1]
    w = torch.randn(2 * n, device=device).to(dtype)[::2]  # strided parameters
    b = torch.randn(n, 2, device=device).to(dtype)[:, 1]
    _check(x, w, b)


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 8), (3, 0)])
def test_empty(shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    w = torch.ones(shape[-1], device=device, requires_grad=True)
    b = torch.zeros(shape[-1], device=device, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 400),
    dtype=st.sampled_from(DTYPES),
    affine=st.sampled_from(AFFINE),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
    scale=st.floats(1e-2, 1e2),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(rows, cols, dtype, affine, eps, scale, seed):
    x, w, b = _inputs((rows, cols), dtype, DEVICE, affine, seed=seed)
    _check((x.float() * scale).to(dtype), w, b, eps, dy_scale=min(scale, 1.0))


@settings(max_examples=10, deadline=None)
@given(
    rows=st.integers(1, 8),
    cols=st.integers(2, 300),
    shift=st.floats(-50, 50),
    scale=st.floats(1e-2, 1e2),
    seed=st.integers(0, 2**16),
)
def test_property_invariants(rows, cols, shift, scale, seed):
    """Without affine and eps: rows come out with mean 0 and variance 1, and shifting or
    scaling the input changes nothing (up to fp32 rounding)."""
    x, _, _ = _inputs((rows, cols), torch.float32, DEVICE, seed=seed, mean=0.0)
    y = layer_norm(x, None, None, 0.0)
    yd = y.double()
    zeros = torch.zeros(rows, dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(yd.mean(-1), zeros, atol=1e-5, rtol=0)
    torch.testing.assert_close(yd.var(-1, unbiased=False), zeros + 1, atol=1e-4, rtol=0)
    # x * scale + shift is itself rounded to fp32 (at shift 33, scale 1/16 that alone moves the
    # normalized row by ~6e-5 relative, past the fp32 rtol), so the invariance is checked on the
    # input the kernel actually gets: against the fp64 reference of that same shifted input.
    xs = x * scale + shift
    assert_close(layer_norm(xs, None, None, 0.0), layer_norm_reference(xs.double(), None, None, 0.0),
                 msg="shift/scale invariance")


@pytest.mark.parametrize("looped", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_deterministic(looped, monkeypatch, device):
    cols = 781
    if looped:  # the looped path at a small width, as in test_looped_path_small
        monkeypatch.setattr(rms_norm_module, "MAX_FUSED_N", 64)
        monkeypatch.setattr(rms_norm_module, "LOOP_BLOCK_N", 32)
        cols = 150
    x, w, b = _inputs((23, cols), torch.bfloat16, device, seed=5)
    dy = torch.randn(23, cols, device=device).to(torch.bfloat16)
    outs = []
    for _ in range(2):
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = layer_norm(xs, ws, bs)
        y.backward(dy)
        outs.append([y, xs.grad, ws.grad, bs.grad])
    assert SPEC.deterministic
    for a, c in zip(*outs):
        assert torch.equal(a, c)


def test_torch_compile_no_graph_break(device):
    x, w, b = _inputs((2, 6, 40), torch.bfloat16, device, seed=6)

    def block(x, w, b):
        return layer_norm(x * 2.0, w, b, 1e-6) + layer_norm(x, None, None)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, block):
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs)
        y.float().pow(2).sum().backward()
        results.append([y, xs.grad, ws.grad, bs.grad])
    for a, c in zip(*results):
        assert torch.equal(a, c)  # the same kernels run either way


def test_custom_ops_opcheck(device):
    """Fake (meta) implementations agree with the real ones; schemas are sound."""
    x, w, b = _inputs((5, 33), torch.bfloat16, device)
    torch.library.opcheck(torch.ops.kprof.layer_norm_fwd, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.kprof.layer_norm_fwd, (x, None, None, 1e-5))
    torch.library.opcheck(torch.ops.kprof.layer_norm_fwd, (x, w.float(), None, 1e-5))
    y, stats = torch.ops.kprof.layer_norm_fwd(x, w, b, 1e-5)
    assert stats.shape == (3, 5)  # per row: the mean as a (hi, lo) pair, rstd
    dy = torch.randn_like(y)
    bwd = torch.ops.kprof.layer_norm_bwd
    torch.library.opcheck(bwd, (dy, x, w, stats, torch.bfloat16, torch.bfloat16))
    torch.library.opcheck(bwd, (dy, x, w, stats, torch.float32, None))
    torch.library.opcheck(bwd, (dy, x, None, stats, None, None))
    _, dw, db = bwd(dy, x, w, stats, torch.float32, None)
    assert dw.dtype == torch.float32 and dw.shape == (33,) and db.shape == (0,)


def test_eager_path_launches_directly(monkeypatch, device):
    """Eager fwd+bwd: no kprof:: op through the dispatcher, the three kernels launched directly,
    and no aten op but the allocations and the rstd row of stats (a view, the kernels' RSTD
    pointer): as rms_norm's (test_rms_norm.py::test_eager_path_launches_directly)."""
    from test_softmax import _LaunchLog, _OpLog

    launches: list[str] = []
    for mod, name in ((layer_norm_module, "_layer_norm_fwd_kernel"), (layer_norm_module, "_layer_norm_bwd_kernel"),
                      (rms_norm_module, "_partials_sum_kernel")):
        monkeypatch.setattr(mod, name, _LaunchLog(name, launches))
    x, w, b = (t.requires_grad_() for t in _inputs((4, 3, 32), torch.bfloat16, device))
    dy = torch.randn(4, 3, 32, device=device, dtype=torch.bfloat16)

    def fwd_bwd():
        x.grad = w.grad = b.grad = None  # no accumulation ops
        layer_norm(x, w, b).backward(dy)

    fwd_bwd()  # the first call of a shape builds its launch plans
    launches.clear()
    with _OpLog() as log:
        fwd_bwd()
    assert launches == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_partials_sum_kernel"]
    allocs = ["aten.empty_like.default", "aten.empty.memory_format", "aten.select.int"]  # y, stats, rstd
    allocs += ["aten.empty_like.default"] + ["aten.empty.memory_format"] * 2 + ["aten.select.int"]  # dx, partials
    allocs += ["aten.empty.memory_format"] * 2  # dw, db
    assert [op for op in log.ops if op != "aten.detach.default"] == allocs, log.ops


def test_module_rejects_multi_dim_shapes(device):
    with pytest.raises(KprofError, match="last dim only"):
        LayerNorm((4, 8))
    m = LayerNorm(8, device=device)
    with pytest.raises(KprofError, match="last dim 8"):
        m(torch.randn(2, 9, device=device))


def test_fallback_without_triton(monkeypatch):
    """CPU without the interpreter: warns once and runs the reference (with autograd)."""
    from kprof.kernels import common as _common

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(_common, "_warned", set())
    x, w, b = _inputs((3, 5), torch.float32, "cpu")
    with pytest.warns(UserWarning, match="layer_norm.*reference"):
        y = layer_norm(x, w, b)
    assert torch.equal(y, F.layer_norm(x, (5,), w, b, 1e-5))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: (torch.ones(3, 4, dtype=torch.int32, device=d), None, None), "torch.int32"),
        (lambda d: (torch.ones(3, 4, dtype=torch.float64, device=d), None, None), "torch.float64"),
        (lambda d: (torch.ones(3, 4, device=d), torch.ones(4, dtype=torch.float64, device=d), None), "weight torch.float64"),
        (lambda d: (torch.tensor(1.0, device=d), None, None), "scalar"),
        (lambda d: (torch.ones(3, 4, device=d), torch.ones(5, device=d), None), r"weight must have shape \(4,\).*\(5,\)"),
        (lambda d: (torch.ones(3, 4, device=d), None, torch.ones(3, 4, device=d)), r"bias must have shape \(4,\)"),
    ],
)
def test_bad_input(make, match, device):
    with pytest.raises(KprofError, match=match):
        layer_norm(*make(device))


def test_cost_model():
    n_rows, n_cols = 16384, 4096
    n = n_rows * n_cols
    c = SPEC.cost(n_rows=n_rows, n_cols=n_cols, dtype=torch.bfloat16)
    stats = 3 * n_rows * 4  # the mean pair (hi, lo) and rstd, fp32
    assert c["fwd"].bytes == 2 * n * 2 + 2 * n_cols * 2 + stats  # x, w, b -> y, stats
    assert c["bwd"].bytes == 3 * n * 2 + 3 * n_cols * 2 + stats  # dy, x, w, stats -> dx, dw, db
    assert c["fwd"].flops == 9 * n and c["bwd"].flops == 14 * n
    bare = SPEC.cost(n_rows=n_rows, n_cols=n_cols, dtype=torch.bfloat16, has_weight=False, has_bias=False)
    assert bare["fwd"].bytes == 2 * n * 2 + stats and bare["bwd"].bytes == 3 * n * 2 + stats

    x = registry.TensorMeta((4, 4096, 4096), torch.bfloat16)
    p = registry.TensorMeta((4096,), torch.bfloat16)
    stat = registry.TensorMeta((3, 4, 4096), torch.float32)
    assert registry.op_cost("kprof::layer_norm_fwd", [x, p, p]) == c["fwd"]
    assert registry.op_cost("kprof::layer_norm_fwd", [x]).bytes == bare["fwd"].bytes
    assert registry.op_cost("kprof::layer_norm_bwd", [x, x, p, stat]) == c["bwd"]
    assert registry.op_cost("kprof::layer_norm_bwd", [x, x, stat]) == bare["bwd"]
    assert registry.get("layer_norm") is SPEC


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    """See test_rms_norm.test_kernels_compile_for_sm90: the compiler, not the interpreter."""
    pytest.importorskip("triton.backends.nvidia")
    from test_rms_norm import aot_compile, partial_ptrs

    variants = []
    for cols, dtypes in ((4096, ("*bf16", "*fp32")), (MAX_FUSED_N + 1, ("*bf16",))):  # in-register, looped
        f, b = layer_norm_module._forward_config(cols), _bwd_config(cols)
        for dtype in dtypes:
            for affine in (True, False):
                variants.append(("_layer_norm_fwd_kernel", dtype, dict(
                    HAS_WEIGHT=affine, HAS_BIAS=affine, LOOP=f.loop, EMULATE_RTNE=False, TREE_EMU=False,
                    BLOCK_M=f.block_m, BLOCK_N=f.block_n), f.num_warps))
                acc64 = dtype == "*fp32"  # fp64 weight-grad partials for fp32 inputs only
                variants.append(("_layer_norm_bwd_kernel", dtype, dict(
                    HAS_WEIGHT=affine, COMPUTE_DW=affine, COMPUTE_DB=affine, LOOP=b.loop, EMULATE_RTNE=False,
                    ACC_F64=acc64, TREE_EMU=False,
                    BLOCK_M=b.block_m, BLOCK_N=b.block_n), b.num_warps, partial_ptrs(acc64)))
    aot_compile("kprof.kernels.layer_norm", variants)


def _bwd_config(cols):
    return rms_norm_module.RowConfig.backward(cols, layer_norm_module.BWD_BLOCK_ELEMS, layer_norm_module.BWD_MAX_WARPS)

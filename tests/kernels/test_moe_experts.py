"""MoE experts (kprof.kernels.moe_experts): torch._grouped_mm + packed SwiGLU against the loop
over experts, forward and the grads of x, w_gate_up and w_down, fp32 and bf16, with empty experts
and all rows on one expert; the fallback where _grouped_mm refuses the strides.

fp32 is compared with the loop in fp64. bf16 is compared with the loop in bf16 using the same
activation (`glu.swiglu_packed`, fp32 inside, rounded once): measured on the CPU, the loop with
eager `silu(g) * u` (which rounds twice) differs from both paths by up to 0.16 at |d w_gate_up| ~ 26
(one bf16 ulp there, and as far from fp64 as the kernel path), while with the same activation the
grouped GEMM and the loop agree exactly; so the check isolates the grouped GEMM.
"""

from __future__ import annotations

import pytest
import torch

from kprof.errors import KprofError
from kprof.kernels import moe_experts as X
from kprof.kernels.common import assert_close, assert_close_sum
from kprof.kernels.glu import swiglu_packed

DTYPES = [torch.float32, torch.bfloat16]
# (rows per expert, hidden, intermediate): H and I multiples of 8 (_grouped_mm's 16-byte strides)
CASES = [
    ((5, 0, 7, 8, 0), 24, 40),  # two empty experts
    ((0, 0, 29, 0), 16, 8),  # all rows on one expert
    ((), 16, 8),  # no experts' rows at all: filled below as zero rows over 3 experts
    pytest.param((40, 3, 0, 17, 1, 9, 0, 22), 64, 96, marks=pytest.mark.slow),
    pytest.param((512,) * 8, 1024, 2816, marks=pytest.mark.gpu),  # the Mixtral layer
]


def inputs(counts, h, i, dtype, device, seed=0):
    counts = counts or (0, 0, 0)
    g = torch.Generator().manual_seed(seed)
    e, n = len(counts), sum(counts)
    x = torch.randn(n, h, generator=g).to(dtype).to(device)
    wgu = (torch.randn(e, h, 2 * i, generator=g) / h**0.5).to(dtype).to(device)
    wd = (torch.randn(e, i, h, generator=g) / i**0.5).to(dtype).to(device)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    dy = torch.randn(n, h, generator=g).to(dtype).to(device)
    return x, offs, wgu, wd, dy


def run(fn, x, offs, wgu, wd, dy):
    ts = [t.detach().clone().requires_grad_() for t in (x, wgu, wd)]
    y = fn(ts[0], offs, ts[1], ts[2])
    grads = torch.autograd.grad(y, ts, dy) if y.numel() else [torch.zeros_like(t) for t in ts]
    return y, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts, h, i", CASES, ids=lambda v: str(v))
def test_matches_reference(counts, h, i, dtype, device):
    x, offs, wgu, wd, dy = inputs(counts, h, i, dtype, device)
    assert X.grouped_mm_backend(x, wgu, wd) == "grouped_mm"
    y, grads = run(X.moe_experts, x, offs, wgu, wd, dy)
    if dtype == torch.float32:
        yr, grads_r = run(X.moe_experts_reference, x.double(), offs, wgu.double(), wd.double(), dy.double())
    else:
        def ref(*a):
            return X.moe_experts_reference(*a, act=swiglu_packed)
        yr, grads_r = run(ref, x, offs, wgu, wd, dy)
    assert_close(y, yr, msg="y")
    assert_close(grads[0], grads_r[0], msg="d x")
    # weight grads are sums over each expert's rows (512 at the Mixtral shape): see assert_close_sum
    for name, a, b in zip(("w_gate_up", "w_down"), grads[1:], grads_r[1:]):
        assert_close_sum(a, b, dtype=dtype, msg=f"d {name}")


def test_misaligned_falls_back_with_one_warning(device):
    x, offs, wgu, wd, dy = inputs((3, 4), 13, 8, torch.float32, device)  # 13 * 4 B rows: not 16-byte aligned
    assert X.grouped_mm_backend(x, wgu, wd) == "reference"
    with pytest.warns(UserWarning, match="per-expert loop") as w:
        y, _ = run(X.moe_experts, x, offs, wgu, wd, dy)
    assert len(str(w[0].message).splitlines()) == 1
    assert_close(y, X.moe_experts_reference(x, offs, wgu, wd))


def test_shape_errors():
    x, offs, wgu, wd, _ = inputs((3, 4), 16, 8, torch.float32, "cpu")
    with pytest.raises(KprofError, match="disagree"):
        X.moe_experts(x, offs, wgu, wd[:, :, :8])

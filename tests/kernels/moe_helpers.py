"""Inputs and the reference comparison shared by the MoE experts tests (test_moe_experts.py for
the `_grouped_mm` path, test_moe_grouped_gemm.py for the Triton grouped GEMM). Weight grads are
compared per expert by relative Frobenius error (`common.assert_close_sum`), everything else
elementwise with the tolerance table unless a test says why not.

fp32 is compared with the per-expert loop in fp64. test_moe_grouped_gemm.py compares 16-bit with
the loop in fp64 too; test_moe_experts.py compares the `_grouped_mm` path's 16-bit results with
the loop in the same dtype using the same activation (`glu.swiglu_packed`, fp32 inside, rounded
once): measured on the CPU, the loop with eager `silu(g) * u` (which rounds twice) differs from
both grouped paths by up to 0.16 at |d w_gate_up| ~ 26 (one bf16 ulp there, and as far from fp64
as the grouped paths), while with the same activation the grouped GEMM and the loop agree
exactly; so the check isolates the grouped GEMM.
"""

from __future__ import annotations

import torch

from kprof.kernels.common import assert_close, assert_close_sum
from kprof.kernels.glu import swiglu_packed
from kprof.kernels.moe_grouped_gemm import moe_grouped_gemm_reference

GRAD_NAMES = ("x", "w_gate_up", "w_down")


def inputs(counts, h, i, dtype, device, seed=0):
    """(x, offsets, w_gate_up, w_down, dy) for `counts` rows per expert (empty: zero rows over 3
    experts); weights scaled by 1 / sqrt(fan-in) so activations stay O(1)."""
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
    """(y, [dx, d w_gate_up, d w_down]) of fn's forward and backward with upstream grad dy."""
    ts = [t.detach().clone().requires_grad_() for t in (x, wgu, wd)]
    y = fn(ts[0], offs, ts[1], ts[2])
    grads = torch.autograd.grad(y, ts, dy) if y.numel() else [torch.zeros_like(t) for t in ts]
    return y, grads


def reference(x, offs, wgu, wd, dy, in_fp64=True):
    """The loop's (y, grads): in fp64 (in_fp64, or fp32 inputs), else in the inputs' dtype with
    the kernels' activation (see the module docstring)."""
    if in_fp64 or x.dtype == torch.float32:
        return run(moe_grouped_gemm_reference, x.double(), offs, wgu.double(), wd.double(), dy.double())

    def ref(*a):
        return moe_grouped_gemm_reference(*a, act=swiglu_packed)

    return run(ref, x, offs, wgu, wd, dy)


def check_matches_reference(fn, counts, h, i, dtype, device, ref_in_fp64=True, dx_by_rows=False):
    """fn's forward and its grads of x, w_gate_up, w_down against `reference`. y elementwise with
    the dtype's tolerance; the weight grads per expert by relative Frobenius error
    (`assert_close_sum`: they are sums over the expert's rows); dx elementwise, or with
    dx_by_rows per row by relative error too (for 16-bit dx, a sum over 2I products of rounded
    intermediates: see test_moe_grouped_gemm.py)."""
    args = inputs(counts, h, i, dtype, device)
    y, grads = run(fn, *args)
    yr, grads_r = reference(*args, in_fp64=ref_in_fp64)
    assert_close(y, yr, msg="y")
    (assert_close_sum if dx_by_rows else assert_close)(grads[0], grads_r[0], msg="d x")
    for name, a, b in zip(GRAD_NAMES[1:], grads[1:], grads_r[1:]):
        assert_close_sum(a, b, msg=f"d {name}")

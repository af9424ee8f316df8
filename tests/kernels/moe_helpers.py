"""Inputs and the reference comparison shared by the MoE experts tests (test_moe_experts.py for
the `_grouped_mm` path, test_moe_grouped_gemm.py for the Triton grouped GEMM).

fp32 is compared with the per-expert loop in fp64. test_moe_grouped_gemm.py compares 16-bit with
the loop in fp64 too (see there for the criterion); test_moe_experts.py compares the
`_grouped_mm` path's 16-bit results with the loop in the same dtype using the same activation (`glu.swiglu_packed`, fp32 inside, rounded once): measured on the
CPU, the loop with eager `silu(g) * u` (which rounds twice) differs from both grouped paths by up
to 0.16 at |d w_gate_up| ~ 26 (one bf16 ulp there, and as far from fp64 as the grouped paths),
while with the same activation the grouped GEMM and the loop agree exactly; so the check isolates
the grouped GEMM.
"""

from __future__ import annotations

import torch

from kprof.kernels.common import assert_close, tol
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


def assert_per_expert_fro(actual, expected, parts, msg=""):
    """||actual[p] - expected[p]||_F <= rtol * ||expected[p]||_F for each part p (an expert's
    weight grad, or an expert's rows of dx), rtol from actual's dtype entry."""
    rtol = tol(actual.dtype).rtol
    for e, p in enumerate(parts):
        a, b = actual[p].double(), expected[p].double()
        err, ref = (a - b).norm().item(), b.norm().item()
        assert err <= rtol * ref, f"{msg} expert {e}: |diff|_F {err:.3g} > {rtol} * |ref|_F {ref:.3g}"


def check_matches_reference(fn, counts, h, i, dtype, device, ref_in_fp64=True, grads_fro=False):
    """fn's forward and its grads of x, w_gate_up, w_down against `reference`: y elementwise with
    the dtype's tolerance; the grads elementwise too, or with grads_fro per expert in relative
    Frobenius norm (dx over the expert's rows, the weight grads over the expert's slice), for
    grads that are sums over 16-bit intermediates (see test_moe_grouped_gemm.py)."""
    args = inputs(counts, h, i, dtype, device)
    y, grads = run(fn, *args)
    yr, grads_r = reference(*args, in_fp64=ref_in_fp64)
    assert_close(y, yr, msg="y")
    ends = torch.tensor(counts or (0, 0, 0)).cumsum(0).tolist()
    row_parts = [slice(s, e) for s, e in zip([0, *ends[:-1]], ends)]
    for name, a, b in zip(GRAD_NAMES, grads, grads_r):
        if grads_fro:
            assert_per_expert_fro(a, b, row_parts if name == "x" else range(len(ends)), msg=f"d {name}")
        else:
            assert_close(a, b, msg=f"d {name}")

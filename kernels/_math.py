"""Math helpers shared by the Triton kernels.

`exp_fast`: Triton lowers `tl.exp` to `ex2.approx.f32` without .ftz, which ptxas turns into four
instructions (a compare for results below 2^-126, two predicated scalings around MUFU.EX2) where
.ftz needs one. In the streaming kernels that are issue-bound rather than DRAM-bound on the H200
(ncu, 2026-11-29: cross-entropy 76% SM vs 64% DRAM throughput, bias+GELU backward 73% vs 46%)
that is ~3 of 11-12 SASS instructions per element per exp (cuobjdump, sm_90a). Flushing results
below 2^-126 (1.2e-38) to zero changes nothing these kernels store: a softmax probability or a
sigmoid tail that small is zero in every output dtype, and far below every tolerance.

The Triton interpreter (CPU CI) has no inline PTX, so the launchers pass FAST=`fast_math(t)`,
False there: it then computes the same function with `tl.exp`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kprof.kernels._common import interpreter_enabled

@triton.jit
def exp_fast(x, FAST: tl.constexpr):
    """exp(x) for an fp32 block: ex2.approx.ftz.f32(x * log2(e)) on the GPU, tl.exp otherwise."""
    if FAST:
        return tl.inline_asm_elementwise(
            # the argument is x * log2(e)
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp(x)


# Read once: Triton itself reads TRITON_INTERPRET when it is imported, and the launchers are
# on the eager hot path (an environment lookup per call is ~1 us of host time).
_COMPILED = not interpreter_enabled()


def fast_math(t: torch.Tensor) -> bool:
    """Whether a kernel launched on t's device may use inline PTX (exp_fast's FAST)."""
    return _COMPILED and t.is_cuda

"""Math helpers shared by the Triton kernels.

`exp_fast`: Triton lowers `tl.exp` to `ex2.approx.f32` without .ftz, which ptxas turns into four
instructions (a compare for results below 2^-126, two predicated scalings around MUFU.EX2) where
.ftz needs one. In the streaming kernels that are issue-bound rather than DRAM-bound on the H200
(ncu: cross-entropy 76% SM vs 64% DRAM throughput, bias+GELU backward 73% vs 46%)
that is ~3 of 11-12 SASS instructions per element per exp (cuobjdump, sm_90a). Flushing results
below 2^-126 (1.2e-38) to zero changes nothing these kernels store: a softmax probability or a
sigmoid tail that small is zero in every output dtype, and far below every tolerance.

`exp2_fast`: the same instruction for an argument already scaled by log2(e): kernels that build
the argument from constants (a polynomial, c * g^2) fold log2(e) into those constants and save the
FMUL that exp_fast spends on it (bias+GELU's erf path: two exps per element).

`rcp_fast`: Triton lowers an fp32 `a / b` to `div.full.f32` (max error 2 ulp), which ptxas turns
into five instructions around MUFU.RCP (FSETP |b| > 2^126, a predicated FMUL b * 0.25, FSEL and
FMUL to rescale; cuobjdump, sm_90a, Triton 3.6 and 3.9). `rcp.approx.ftz.f32` is MUFU.RCP alone,
max error 1 ulp (PTX ISA). The callers divide by 1 + e with e >= 0 or by 1 + z / 2 with z >= 0: the
divisor is >= 1, so the reciprocal is in (0, 1]; .ftz matters only past a divisor of 2^126, where
the true reciprocal (< 1.2e-38) is zero in every output dtype. The quotient a * rcp(b) then carries
at most 1 ulp + the multiply's 0.5 ulp, no worse than div.full's 2 ulp, and nothing subtracts
quotients of nearly equal size downstream (see `act_and_grad`), so it stays a few fp32 ulp
(~2e-7 relative): 100x below the fp32 tolerance (rtol 2e-5) and far below bf16/fp16 rounding.

`to_f32_fast`: bf16 -> fp32 is the bf16 bits shifted into the top half of the word. Triton
converts element by element: for the element in the high half of a loaded 32-bit word ptxas emits
PRMT (move it down) + shift back up, 3 instructions per pair of elements; taking the pair as one
word, `shl 16` (low element) and `and 0xffff0000` (high element) are 2. bias+GELU's backward
converts dy and x: 1 instruction per element of its ~22-29 (sm_90a). Exact, like the conversion it
replaces (NaN payloads included). Element order, checked in the PTX (Triton 3.9): the inline asm
gets the loaded word whose low half is the lower-addressed element, and its first output is the
first of the two elements.

The Triton interpreter (CPU CI) has no inline PTX, so the launchers pass
FAST=`common.fast_math(t)`, False there: it then computes the same function with `tl.exp`, `tl.exp2`, `1.0 / x` and `.to`.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp2_fast(x, FAST: tl.constexpr):
    """2^x for an fp32 block: ex2.approx.ftz.f32 on the GPU, tl.exp2 otherwise."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def exp_fast(x, FAST: tl.constexpr):
    """exp(x) for an fp32 block: ex2.approx.ftz.f32(x * log2(e)) on the GPU, tl.exp otherwise."""
    if FAST:
        return exp2_fast(x * LOG2E, FAST)
    else:
        return tl.exp(x)


@triton.jit
def rcp_fast(x, FAST: tl.constexpr):
    """1 / x for an fp32 block: rcp.approx.ftz.f32 on the GPU (1 ulp), `1.0 / x` otherwise."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def to_f32_fast(x, FAST: tl.constexpr):
    """x (any float block) as fp32; bf16 pairs by shift and mask on the GPU (see above).

    Pairs need an even number of elements in each thread: a block of >= 2048 elements (powers of
    two) gives every thread >= 2 at up to 32 warps. Smaller blocks (tiny or odd shapes: a 1x1
    tile is one element a thread, which Triton rejects for inline asm with pack=2) take the
    plain conversion."""
    if FAST and x.dtype == tl.bfloat16 and x.numel >= 2048:
        return tl.inline_asm_elementwise(
            "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2
        )
    else:
        return x.to(tl.float32)

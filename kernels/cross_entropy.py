"""Cross-entropy over logits [N, V] whose forward also writes the gradient (one fused kernel).

Eager `F.cross_entropy(logits.float(), target)` on bf16 logits 8192 x 128256 upcasts the logits
(4.2 GB fp32), runs log_softmax (another 4.2 GB), and the backward reads them again: 13.5 ms and
~10 GB extra on an H200. Here one kernel reads each row, computes the loss, and writes
d loss / d logits in the same launch; the backward only scales that gradient by grad_output,
and skips even that on the device when grad_output == 1 (the usual `loss.backward()`).

Why: bf16 8192 x 128256 logits are 2.10 GB, so reading them once and writing the gradient once
is a 0.98 ms floor at the H200's 4.27 TB/s (target <= 1.15 ms). A row (128256 bf16 = 256 KB)
cannot stay in one SM's registers, so this kernel reads each row twice: pass 1 (online logsumexp
over V in blocks), pass 2 (softmax - onehot, written as the gradient), walking the row backwards
so it first re-reads the blocks pass 1 read last from L2 (loads evict_last, then evict_first,
gradient stores streaming). Each thread keeps an online max and sum for its own 16-byte vector
of columns, full blocks load unmasked, the next block is loaded before the current one's math,
and exp is ex2.approx.ftz (kprof.kernels._math): fwd+bwd 1.26-1.29 ms on the H200 (ncu: 2.39 GB
read, 2.08 GB written, 67% of DRAM peak). On Hopper (sm_90+) `_ce_fwd_launch` first tries
`cross_entropy_sm90`, a CUDA C++ kernel in which the CTAs of a thread-block cluster share each
row, so every logit is read from DRAM once: 1.107-1.115 ms in the same runs. This Triton kernel
is the fallback and the reference for it: earlier GPUs, rows that are not 16-byte aligned, rows
over 262144 (fp32: 131072) columns or in the range where the cluster shapes are part-filled
(bf16 V in (131072, 229376]), the softcap (slower there), or no NVRTC. Rows up to
`CEConfig.single_block_max` columns are loaded once and kept in registers. Both kernels compute
the same function; tests/kernels/test_cross_entropy_sm90.py checks both.

Semantics match `F.cross_entropy` on fp32 logits: mean over non-ignored targets (all ignored ->
nan, like torch), label smoothing as torch defines it (eps/V spread over all classes, ignored
rows excluded), ignored rows get zero gradient. Extras: `z_loss` (PaLM, arXiv:2204.02311 sec. 5:
adds z * logsumexp^2 per non-ignored token) and `softcap` (Gemma 2: logits -> c*tanh(logits/c)
before the loss, gradient through the tanh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels import cross_entropy_sm90 as _sm90
from kprof.kernels.common import (
    FP_FUSION,
    _REAL_TENSORS,
    fast_math,
    kernel_op,
    launch,
    num_warps,
    persistent_programs,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels._math import exp_fast
from kprof.kernels.registry import Cost, KernelSpec, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_REDUCTIONS = ("mean", "sum", "none")


# ----------------------------------------------------------------------------------------------
# 1. Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(u):
    # No libdevice tanh in the interpreter, so build it from exp. (1-e)/(1+e) with e = exp(-2|u|)
    # loses relative precision as |u| -> 0 (1-e cancels), so below |u| = 1/16 use the odd Taylor
    # series to u^5 (next term 17/315 u^7 < 2e-10 there); above, the fp32 relative error is
    # <= ulp(1)/(1-e) ~ 5e-7 at |u| = 1/16 and shrinks with |u|.
    au = tl.abs(u)
    e = tl.exp(-2.0 * au)
    big = (1.0 - e) / (1.0 + e)
    u2 = au * au
    small = au * (1.0 - u2 * (0.3333333333333333 - u2 * 0.13333333333333333))
    t = tl.where(au < 0.0625, small, big)
    return tl.where(u < 0.0, -t, t)


@triton.jit
def _ce_grad_block(z, t, is_y, m, p_coef, smooth_g, target_g, HAS_SMOOTHING: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_TARGET: tl.constexpr, FAST: tl.constexpr):
    # d loss / d z_j = softmax_j * (1 + 2 z_loss lse) - eps/V - (1 - eps) [j == y], all times the
    # grad scale; the caller folds the scale (and 1/d, see below) into p_coef, smooth_g, target_g.
    # softmax_j = exp(z_j - m) / d rather than exp(z_j - lse): z_j - m is exact when z_j is near
    # m, while lse = m + log(d) rounds at |m|'s scale (measured: a flat fp32 row at -1e4 gave
    # softmax off by 3e-4 relative through lse). Then through the softcap: dz/dx = 1 - tanh^2.
    # HAS_TARGET False: the block holds no target column (the looped path writes that one apart).
    g = exp_fast(z - m, FAST) * p_coef
    if HAS_SMOOTHING:
        g = g - smooth_g
    if HAS_TARGET:
        g = tl.where(is_y, g - target_g, g)
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    return g


@triton.jit
def _ce_raw(x_row, offs, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    # One [G, VEC] block of a row in the input dtype. Full blocks load without a mask: the mask's
    # compare and select per element are a measurable share of an issue-bound loop (ncu: 68% of
    # SM throughput). Nothing here waits for the data, so the row loops issue the
    # next block's load before the math on the current one (see the pass loops).
    if MASKED:
        return tl.load(x_row + offs, mask=mask, other=0.0, eviction_policy=EVICT)
    else:
        return tl.load(x_row + offs, eviction_policy=EVICT)


@triton.jit
def _ce_prep(raw, mask, softcap, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    # fp32 values after the softcap (masked lanes -inf), and t = tanh(x / softcap) for the
    # softcap's gradient.
    x = raw.to(tl.float32)
    t = x
    if HAS_SOFTCAP:
        t = _tanh(x / softcap)
        x = softcap * t
    if MASKED:
        x = tl.where(mask, x, float("-inf"))
    return x, t


@triton.jit
def _ce_lse_update(x, mask, m_v, d_v, s_v, n_v, first, MASKED: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
                   FAST: tl.constexpr):
    # Online logsumexp per group of VEC columns (one thread's vector): m_v running max, d_v =
    # sum exp(z - m_v), s_v = sum (z - m_v) (label smoothing), n_v = columns seen. The max and sums
    # are over axis 1, inside each thread: no shuffle, no barrier in the row loop. One exp per
    # column plus one per VEC columns for the rescale.
    m_new = tl.maximum(m_v, tl.max(x, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - 0) = 0, not nan
    d_v = d_v * exp_fast(m_v - m_sub, FAST) + tl.sum(exp_fast(x - m_sub[:, None], FAST), 1)
    if HAS_SMOOTHING:
        # re-base the n_v terms seen so far from m_v to m_new (none before the first block)
        s_v = tl.where(first, s_v, s_v + n_v * (m_v - m_new))
        if MASKED:
            s_v += tl.sum(tl.where(mask, x - m_new[:, None], 0.0), 1)
            n_v += tl.sum(mask.to(tl.float32), 1)
        else:
            s_v += tl.sum(x - m_new[:, None], 1)
            n_v += x.shape[1]
    return m_new, d_v, s_v, n_v


@triton.jit
def _ce_fwd_kernel(
    logits_ptr,
    stride_l,  # row stride of logits; the last dim has unit stride
    target_ptr,
    grad_ptr,  # [n_rows, n_cols] with row stride stride_g; may be logits_ptr (in place)
    stride_g,
    loss_ptr,  # [n_rows] fp32 per-row loss (0 for ignored rows)
    scale_ptr,  # fp32 gradient scale: one value (scale_stride 0) or one per row (scale_stride 1)
    scale_stride,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,  # n_cols <= BLOCK: load the row once and keep it in registers
    BLOCK: tl.constexpr,
    VEC: tl.constexpr,  # columns per thread-group in the looped path: 16 bytes of the input dtype
    FAST: tl.constexpr,  # exp via ex2.approx.ftz (kprof.kernels._math); False in the interpreter
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    n_blocks = tl.cdiv(n_cols, BLOCK)
    # Looped path: a block is [G, VEC], VEC contiguous columns a thread (one 16-byte load).
    G: tl.constexpr = BLOCK // VEC
    grp = tl.arange(0, G)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    n_full = n_cols // BLOCK
    tail = n_full * BLOCK
    # Persistent grid: each program walks rows pid, pid + n_progs, ... (see CEConfig).
    # The next row's target and (looped path) first block are loaded one row ahead, and z_y and
    # the scale at the top of the row: otherwise a row waits on ~4 dependent memory round trips
    # (target -> branch -> first block; z_y after pass 1; ...), each ~1 us, with one program per
    # SM and ~62 rows each at the shape (H200: 1.37 ms with them exposed).
    y_nxt = tl.load(target_ptr + tl.minimum(pid, n_rows - 1)).to(tl.int32)  # host-validated: ignore_index or in [0, V)
    if not SINGLE_BLOCK:
        first_mask = grp < n_cols
        r0 = tl.zeros([], tl.int64) + tl.minimum(pid, n_rows - 1)
        blk_nxt = tl.load(logits_ptr + r0 * stride_l + grp, mask=first_mask, other=0.0, eviction_policy="evict_last")
    for row in range(pid, n_rows, n_progs):
        row64 = tl.zeros([], tl.int64) + row  # row * stride overflows int32 past 2^31 elements
        x_row = logits_ptr + row64 * stride_l
        g_row = grad_ptr + row64 * stride_g
        y = y_nxt
        nrow = tl.minimum(row + n_progs, n_rows - 1)  # past the end: a harmless reload of the last row
        y_nxt = tl.load(target_ptr + nrow).to(tl.int32)
        if not SINGLE_BLOCK:
            blk = blk_nxt
            nrow64 = tl.zeros([], tl.int64) + nrow
            blk_nxt = tl.load(logits_ptr + nrow64 * stride_l + grp, mask=first_mask, other=0.0, eviction_policy="evict_last")
        if y == ignore_index:
            tl.store(loss_ptr + row, 0.0)
            if COMPUTE_GRAD:
                for b in range(0, n_blocks):
                    offs = b * BLOCK + cols
                    tl.store(g_row + offs, tl.zeros([BLOCK], tl.float32).to(grad_ptr.dtype.element_ty), mask=offs < n_cols)
        else:
            z_y_raw = tl.load(x_row + y)  # issued now, used after pass 1
            if COMPUTE_GRAD:
                scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
            # ---- pass 1: max m, d = sum_j exp(z_j - m), and (label smoothing) s = sum_j (z_j - m),
            # kept relative to m so that it is exact for flat rows.
            if SINGLE_BLOCK:
                mask = cols < n_cols
                z, t = _ce_prep(tl.load(x_row + cols, mask=mask, other=0.0), mask, softcap, True, HAS_SOFTCAP)
                m = tl.max(z, 0)
                d = tl.sum(exp_fast(z - m, FAST), 0)
                s = tl.sum(tl.where(mask, z - m, 0.0), 0)
            else:
                m_v = tl.full([G], float("-inf"), tl.float32)
                d_v = tl.zeros([G], tl.float32)
                s_v = tl.zeros([G], tl.float32)
                n_v = tl.zeros([G], tl.float32)
                if n_full > 0:
                    # Software-pipelined by hand: block b + 1's load is in flight while block b's
                    # math runs (Triton 3.6 pipelines no tl.load of this loop by itself). Block 0
                    # was loaded during the previous row.
                    raw = blk
                    for b in range(1, n_full):
                        nxt = _ce_raw(x_row, b * BLOCK + grp, None, False, "evict_last")
                        x, t = _ce_prep(raw, None, softcap, False, HAS_SOFTCAP)
                        m_v, d_v, s_v, n_v = _ce_lse_update(x, None, m_v, d_v, s_v, n_v, b == 1, False, HAS_SMOOTHING, FAST)
                        raw = nxt
                    x, t = _ce_prep(raw, None, softcap, False, HAS_SOFTCAP)
                    m_v, d_v, s_v, n_v = _ce_lse_update(x, None, m_v, d_v, s_v, n_v, n_full == 1, False, HAS_SMOOTHING, FAST)
                if tail < n_cols:
                    offs = tail + grp
                    mask = offs < n_cols
                    x, t = _ce_prep(_ce_raw(x_row, offs, mask, True, "evict_last"), mask, softcap, True, HAS_SOFTCAP)
                    m_v, d_v, s_v, n_v = _ce_lse_update(x, mask, m_v, d_v, s_v, n_v, n_full == 0, True, HAS_SMOOTHING, FAST)
                # the one cross-thread reduction of the row
                m = tl.max(m_v, 0)
                m_sub = tl.where(m == float("-inf"), 0.0, m)
                d = tl.sum(d_v * exp_fast(m_v - m_sub, FAST), 0)
                if HAS_SMOOTHING:
                    s = tl.sum(tl.where(n_v > 0, s_v + n_v * (m_v - m), 0.0), 0)
                else:
                    s = 0.0
            log_d = tl.log(d)
            lse = m + log_d

            # ---- loss = lse - (1-eps) z_y - eps mean_j z_j  (+ z_loss lse^2)
            #           = log d + (1-eps) (m - z_y) - eps s / V
            z_y, t_y = _ce_prep(z_y_raw, None, softcap, False, HAS_SOFTCAP)
            if HAS_SMOOTHING:
                loss = log_d + (1.0 - label_smoothing) * (m - z_y) - (label_smoothing / n_cols) * s
            else:
                loss = log_d + (m - z_y)
            if HAS_Z_LOSS:
                loss += z_loss * lse * lse
            tl.store(loss_ptr + row, loss)

            # ---- pass 2: the gradient, scaled
            if COMPUTE_GRAD:
                p_coef = scale / d
                if HAS_Z_LOSS:
                    p_coef = p_coef * (1.0 + 2.0 * z_loss * lse)
                smooth_g = 0.0
                if HAS_SMOOTHING:
                    smooth_g = scale * (label_smoothing / n_cols)
                target_g = scale * (1.0 - label_smoothing)
                if SINGLE_BLOCK:
                    g = _ce_grad_block(z, t, cols == y, m, p_coef, smooth_g, target_g, HAS_SMOOTHING, HAS_SOFTCAP, True, FAST)
                    tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)
                else:
                    # Backwards from the tail: the blocks pass 1 read last are still in L2 (ncu:
                    # 2.26 GB read from DRAM for 2.10 GB of logits).
                    if tail < n_cols:
                        offs = tail + grp
                        mask = offs < n_cols
                        x, t = _ce_prep(_ce_raw(x_row, offs, mask, True, "evict_first"), mask, softcap, True, HAS_SOFTCAP)
                        g = _ce_grad_block(x, t, None, m, p_coef, smooth_g, 0.0, HAS_SMOOTHING, HAS_SOFTCAP, False, FAST)
                        tl.store(g_row + offs, g.to(grad_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
                    if n_full > 0:  # pipelined like pass 1
                        raw = _ce_raw(x_row, (n_full - 1) * BLOCK + grp, None, False, "evict_first")
                        for i in range(1, n_full):
                            nxt = _ce_raw(x_row, (n_full - 1 - i) * BLOCK + grp, None, False, "evict_first")
                            x, t = _ce_prep(raw, None, softcap, False, HAS_SOFTCAP)
                            g = _ce_grad_block(x, t, None, m, p_coef, smooth_g, 0.0, HAS_SMOOTHING, HAS_SOFTCAP, False, FAST)
                            tl.store(g_row + (n_full - i) * BLOCK + grp, g.to(grad_ptr.dtype.element_ty), cache_modifier=".cs")
                            raw = nxt
                        x, t = _ce_prep(raw, None, softcap, False, HAS_SOFTCAP)
                        g = _ce_grad_block(x, t, None, m, p_coef, smooth_g, 0.0, HAS_SMOOTHING, HAS_SOFTCAP, False, FAST)
                        tl.store(g_row + grp, g.to(grad_ptr.dtype.element_ty), cache_modifier=".cs")
                    # The target column's -(1 - eps) term, written once instead of a compare and
                    # select per column. The barrier orders it after the block store of the same
                    # address by another thread of this program.
                    tl.debug_barrier()
                    g_y = _ce_grad_block(z_y, t_y, True, m, p_coef, smooth_g, target_g, HAS_SMOOTHING, HAS_SOFTCAP, True, FAST)
                    tl.store(g_row + y, g_y.to(grad_ptr.dtype.element_ty))


@triton.jit
def _scale_kernel(
    grad_ptr,  # contiguous
    scale_ptr,  # fp32: one value (SCALAR) or one per row of a [n_rows, n_cols] grad
    n_rows,
    n_cols,  # SCALAR: n_rows is 1 and n_cols the number of elements (may exceed 2^31)
    SCALAR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grad *= scale, in place, skipping work whose scale is exactly 1 on the device (no host sync:
    # `loss.backward()` passes grad_output = 1, and then this launch moves no data).
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    if SCALAR:
        s = tl.load(scale_ptr).to(tl.float32)
        if s != 1.0:
            for tile in range(pid, tl.cdiv(n_cols, BLOCK), n_progs):
                offs = (tl.zeros([], tl.int64) + tile) * BLOCK + cols  # flat, int64-safe
                mask = offs < n_cols
                g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(grad_ptr + offs, (g * s).to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        col_blocks = tl.cdiv(n_cols, BLOCK)
        for tile in range(pid, n_rows * col_blocks, n_progs):
            r = tile // col_blocks
            s = tl.load(scale_ptr + r).to(tl.float32)
            if s != 1.0:
                offs = (tile % col_blocks) * BLOCK + cols
                mask = offs < n_cols
                p = grad_ptr + (tl.zeros([], tl.int64) + r) * n_cols + offs
                g = tl.load(p, mask=mask, other=0.0).to(tl.float32)
                tl.store(p, (g * s).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _count_valid_kernel(target_ptr, n, ignore_index, n_valid_ptr, scale_ptr, BLOCK: tl.constexpr):
    # One program: the number of non-ignored targets (fp32) and its reciprocal, the 'mean'
    # gradient scale (inf when all are ignored; ignored rows never read it).
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + offs, mask=offs < n, other=ignore_index)
        acc += (t != ignore_index).to(tl.int32)
    c = tl.sum(acc, 0).to(tl.float32)
    tl.store(n_valid_ptr, c)
    tl.store(scale_ptr, 1.0 / c)


@triton.jit
def _reduce_loss_kernel(loss_ptr, n, n_valid_ptr, out_ptr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    # One program, fixed order (deterministic): sum of the per-row losses, / n_valid for 'mean'
    # (0 / 0 = nan when all are ignored, like torch), stored in the output dtype.
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(loss_ptr + offs, mask=offs < n, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:
        total = total / tl.load(n_valid_ptr)
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------
# 2. Launch configuration and host launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CEConfig:
    """Launch parameters of the fused cross-entropy kernel; the one place to tune them.

    Register counts below are from ptxas -v for sm_90a on the Triton 3.9 compile (Triton 3.6 may
    differ). An H100/H200 SM has 65536 registers.
    """

    block: int  # columns per load; a power of two
    num_warps: int
    n_programs: int  # persistent grid size
    single_block: bool  # whole row in one block (loaded once)

    # Rows up to this many columns are loaded once and held in registers: 16384 over 16 warps
    # is 32 values a thread (127 registers, no spills), one program per SM.
    single_block_max = 16384

    @classmethod
    def for_problem(cls, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device) -> "CEConfig":
        if device.type != "cuda":
            # Triton interpreter (CPU CI): numpy-vectorized blocks, programs run one after another;
            # big blocks and one program per row keep the Python overhead low.
            block = min(triton.next_power_of_2(max(n_cols, 1)), 8192)
            return cls(block, 4, max(n_rows, 1), n_cols <= block)
        if n_cols <= cls.single_block_max:
            block = triton.next_power_of_2(n_cols)
            warps = num_warps(block, per_thread=32)
            # One read per row, no L2 constraint. Programs per SM by registers: ~1 at 16 warps.
            return cls(block, warps, persistent_programs(n_rows, device, max(1, 16 // warps)), True)
        # Rows over 16384 columns: 16384-column blocks over 32 warps, one program per SM, so the
        # rows in flight (132 x 256 KB) stay inside L2 for pass 2's re-read; with the next row's
        # first block held in registers, 16384 fits (63 registers, ptxas sm_90a) where 32768
        # spills. The fastest of the configurations, row-interleaved and split-row kernels and
        # Triton's software pipeline tried on the H200 (docs/kernels.md).
        return cls(16384, 32, persistent_programs(n_rows, device, 1), False)


def _check_logits_target(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> None:
    if logits.dim() != 2:
        raise KprofError(
            f"cross_entropy expects logits [N, V], got shape {tuple(logits.shape)}; "
            "flatten leading dims first: logits.view(-1, logits.shape[-1]), target.view(-1)"
        )
    if logits.dtype not in _DTYPES:
        raise KprofError(f"cross_entropy supports logits in fp32/fp16/bf16, got {logits.dtype}; cast the logits first")
    if target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise KprofError(
            f"cross_entropy expects target [N] with N = logits.shape[0] = {logits.shape[0]}, got shape {tuple(target.shape)}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise KprofError(f"cross_entropy expects integer class targets (int64 or int32), got {target.dtype}")
    if target.device != logits.device:
        raise KprofError(f"logits are on {logits.device} but target is on {target.device}; move them to one device")
    if logits.shape[1] == 0 and logits.shape[0] > 0:
        raise KprofError("cross_entropy got logits with 0 classes (V == 0)")
    if logits.shape[1] >= 2**31:
        raise KprofError(f"cross_entropy supports V < 2^31 classes, got {logits.shape[1]}")


def _check_target_values(target: torch.Tensor, n_cols: int, ignore_index: int) -> None:
    ok = (target == ignore_index) | ((target >= 0) & (target < n_cols))
    if target.device.type != "cpu":
        # No host sync: a bad target trips a device-side assert, like torch's own cross_entropy.
        # (Meta tensors take this branch too: tests trace linear+CE's body on them, since slicing
        # a fake CUDA tensor needs a CUDA build of torch.)
        torch._assert_async(ok.all(), f"kprof cross_entropy: targets must be in [0, {n_cols}) or ignore_index")
    elif not bool(ok.all()):
        bad = target[~ok][:5].tolist()
        raise KprofError(
            f"cross_entropy targets must be in [0, {n_cols}) or ignore_index={ignore_index}; got e.g. {bad}"
        )


def _ce_fwd_launch(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad: torch.Tensor | None,
    loss_rows: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    config: CEConfig | None = None,
    check_targets: bool = True,
) -> None:
    """Write per-row losses into `loss_rows` and, if `grad` is given, d loss / d logits (times
    `grad_scale`, fp32, one value or one per row) into `grad`, which may be `logits` itself.
    `logits` and `grad` need unit stride along V; any row stride works."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    target = target.contiguous()  # the kernel reads target[row] at unit stride
    if check_targets:  # linear_cross_entropy checks all targets once, not per chunk
        _check_target_values(target, n_cols, ignore_index)
    # Hopper: the cluster kernel (one DRAM read per logit, cross_entropy_sm90.py), on real tensors
    # only. It is CUDA C++ launched through ctypes, which a traced body cannot record, so under
    # torch.compile the Triton kernel runs (H200, bf16 8192 x 128256: 1.26 ms fwd+bwd against
    # the cluster kernel's 1.11 ms).
    if config is None and type(logits) in _REAL_TENSORS and _sm90.try_launch(
        logits, target, grad, loss_rows, grad_scale, ignore_index, label_smoothing, z_loss, softcap
    ):
        return
    cfg = config or CEConfig.for_problem(n_rows, n_cols, logits.dtype, logits.device)
    compute_grad = grad is not None
    g = grad if compute_grad else logits  # unused pointer when not computing the grad
    launch(
        _ce_fwd_kernel,
        (cfg.n_programs,),
        logits,
        logits.stride(0),
        target,
        g,
        g.stride(0),
        loss_rows,
        grad_scale,
        0 if grad_scale.numel() == 1 else 1,
        n_rows,
        n_cols,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap),
        HAS_SMOOTHING=label_smoothing > 0.0,
        HAS_Z_LOSS=z_loss != 0.0,
        HAS_SOFTCAP=softcap > 0.0,
        COMPUTE_GRAD=compute_grad,
        SINGLE_BLOCK=cfg.single_block,
        BLOCK=cfg.block,
        VEC=min(cfg.block, 16 // logits.element_size()),
        FAST=fast_math(logits),
        num_warps=cfg.num_warps,
        **FP_FUSION,
    )


def _scale_launch(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """grad *= scale in place (scale: fp32, one value, or one per row of a 2-D grad); tiles whose
    scale is exactly 1 are skipped on the device."""
    if grad.numel() == 0:
        return
    if not grad.is_contiguous():
        raise KprofError("internal: the fused gradient buffer should be contiguous")
    scalar = scale.numel() == 1
    # One scale: the grad as one flat run (int64 offsets in the kernel; grad_W of a 256000 x 8192
    # head has 2.1e9 > 2^31 elements). One scale per row: [rows, cols] tiles.
    n_rows, n_cols = (1, grad.numel()) if scalar else (grad.shape[0], grad.numel() // grad.shape[0])
    block = 4096 if grad.is_cuda else min(triton.next_power_of_2(n_cols), 8192)
    n_tiles = n_rows * triton.cdiv(n_cols, block)
    # GPU: persistent grid (4 programs per SM of 8 warps); interpreter: one program looping (its
    # cost is per program launched, and a skipped launch then costs one program).
    n_prog = persistent_programs(n_tiles, grad.device, 4) if grad.is_cuda else 1
    launch(_scale_kernel, (n_prog,), grad, scale, n_rows, n_cols, SCALAR=scalar, BLOCK=block,
           num_warps=8 if grad.is_cuda else 4, **FP_FUSION)


# ----------------------------------------------------------------------------------------------
# 3. Registered ops (common.kernel_op: triton_ops Inductor launches itself; the autograd.Function
#    calls the bodies directly in eager mode)
# ----------------------------------------------------------------------------------------------


def _ce_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 losses [N] and d loss / d logits [N, V] (empty [0] if not compute_grad)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    _ce_fwd_launch(logits, target, grad, loss_rows, grad_scale, ignore_index, label_smoothing, z_loss, softcap)
    return loss_rows, grad if grad is not None else logits.new_empty(0)


def _ce_fwd_inplace(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> torch.Tensor:
    """Per-row fp32 losses [N]; overwrites `logits` (unit stride along V) with d loss / d logits."""
    loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _ce_fwd_launch(logits, target, logits, loss_rows, grad_scale, ignore_index, label_smoothing, z_loss, softcap)
    return loss_rows


def _ce_bwd(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """grad *= grad_output in place (grad_output: one value, or one per row of grad); moves no
    data when grad_output is exactly 1. Also used by linear_cross_entropy for its stored grads."""
    _scale_launch(grad, grad_output.to(torch.float32).contiguous())


def _ce_bwd_eager(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """`_ce_bwd` for the eager path, bumping grad's version counter as the op's registered
    mutation does: a second backward through the scaled buffer then raises instead of scaling it
    twice."""
    _ce_bwd(grad, grad_output)
    torch.autograd.graph.increment_version(grad)


_ce_fwd_op = kernel_op("kprof::cross_entropy_fwd")(_ce_fwd)
_ce_fwd_inplace_op = kernel_op("kprof::cross_entropy_fwd_inplace", mutates_args=("logits",))(_ce_fwd_inplace)
_ce_bwd_op = kernel_op("kprof::cross_entropy_bwd", mutates_args=("grad",))(_ce_bwd)


# Shapes-only fakes: Dynamo runs these instead of the bodies, whose target check reads values.
@_ce_fwd_op.register_fake
def _(logits, target, grad_scale, ignore_index, label_smoothing, z_loss, softcap, compute_grad):
    loss_rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return loss_rows, (logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0))


@_ce_fwd_inplace_op.register_fake
def _(logits, target, grad_scale, ignore_index, label_smoothing, z_loss, softcap):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


@_ce_bwd_op.register_fake
def _(grad, grad_output):
    return None


# ----------------------------------------------------------------------------------------------
# 4. autograd.Function
# ----------------------------------------------------------------------------------------------


def _n_valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Non-ignored targets as an fp32 scalar on the device (no host sync). Two kernels (compare,
    sum); computed once per call and shared by the gradient scale and the mean: 5 small kernels
    around the CE kernel instead of 9 (~15 us of the 8192 x 128256 case's GPU time, H200). Exact
    below 2^24 tokens."""
    return (target != ignore_index).sum(dtype=torch.float32)


def _reduce(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
            n_valid: torch.Tensor | None = None) -> torch.Tensor:
    if reduction == "mean":
        # 0/0 = nan when every target is ignored, as F.cross_entropy.
        return loss_rows.sum() / (n_valid if n_valid is not None else _n_valid(target, ignore_index))
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows


def _scale_and_count(target: torch.Tensor, ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gradient scale, n_valid or None) for a forward. Eager: one Triton program for both (the
    torch ops take 3 kernels; each small kernel is ~2-4 us of GPU time beside a ~1.1 ms CE on the
    H200, where the issue's target leaves 35 us). Under torch.compile or a profiler: torch ops."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=target.device), None
    if via_custom_op() or not use_triton(target) or target.numel() == 0:
        n_valid = _n_valid(target, ignore_index)
        return n_valid.reciprocal(), n_valid
    t = target.contiguous()
    out = torch.empty(2, dtype=torch.float32, device=target.device)
    block = min(4096, triton.next_power_of_2(max(t.numel(), 16)))
    _count_valid_kernel[(1,)](t, t.numel(), ignore_index, out, out[1:], BLOCK=block, num_warps=8 if t.is_cuda else 4, **FP_FUSION)
    return out[1], out[0]


def _finish(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
            n_valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The returned loss from the per-row fp32 losses, in `dtype`: one Triton program in eager
    mode (instead of sum, divide and cast), torch ops otherwise."""
    if reduction == "none" or via_custom_op() or not use_triton(loss_rows) or loss_rows.numel() == 0:
        return _cast_result(_reduce(loss_rows, target, ignore_index, reduction, n_valid), dtype)
    # The interpreter truncates fp32 -> bf16 in a kernel instead of rounding (see common): there
    # the kernel stores fp32 and torch rounds (a bf16 Gemma loss was 0.0044 off against a 0.004
    # limit in CPU CI). On the GPU the kernel rounds to nearest itself.
    out = torch.empty((), dtype=dtype if loss_rows.is_cuda else torch.float32, device=loss_rows.device)
    block = min(4096, triton.next_power_of_2(max(loss_rows.numel(), 16)))
    mean = reduction == "mean"
    _reduce_loss_kernel[(1,)](loss_rows, loss_rows.numel(), n_valid if mean else loss_rows, out, MEAN=mean,
                              BLOCK=block, num_warps=8 if loss_rows.is_cuda else 4, **FP_FUSION)
    return _cast_result(out, dtype)


def _cast_result(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, for an autograd.Function forward's return value: `t` itself when the dtype
    already matches, never a `.to()` of it. `t.to(t.dtype)` returns `t`, a second name for the
    same tensor, and torch 2.11's dynamo (pytorch#180642, fixed in 2.12 by pytorch#180921) adds
    such an alias of the returned tensor as an extra output of the traced forward; autograd then
    routes the loss's gradient to that extra output and the backward sees grad_output = 0 (every
    fp32 grad of CE and linear+CE under torch.compile was 0 on the H200)."""
    return t if t.dtype == dtype else t.to(dtype)


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, z_loss, softcap, inplace_grad, need_grad):
        scale, n_valid = _scale_and_count(target, ignore_index, reduction)
        sc = float(softcap or 0.0)
        # In place needs unit stride along V and rows that do not overlap (not an expand()).
        inplace_ok = logits.stride(-1) == 1 and logits.stride(0) >= logits.shape[1]
        op = via_custom_op()  # eager: the bodies themselves, no op dispatch (common.via_custom_op)
        if need_grad and inplace_grad and inplace_ok:
            if op:
                loss_rows = torch.ops.kprof.cross_entropy_fwd_inplace(
                    logits, target, scale, ignore_index, label_smoothing, z_loss, sc
                )
            else:
                loss_rows = _ce_fwd_inplace(logits, target, scale, ignore_index, label_smoothing, z_loss, sc)
                # as the op's registered mutation does: an autograd node that saved the logits
                # then raises in its backward instead of reading the gradient
                torch.autograd.graph.increment_version(logits)
            grad = logits
        else:
            fwd = torch.ops.kprof.cross_entropy_fwd if op else _ce_fwd
            loss_rows, grad = fwd(logits, target, scale, ignore_index, label_smoothing, z_loss, sc, need_grad)
        if need_grad:
            ctx.save_for_backward(grad)
        ctx.reduction = reduction
        return _finish(loss_rows, target, ignore_index, reduction, n_valid, logits.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        # The gradient was computed in the forward; only grad_output remains. Scaling in place is
        # safe because the buffer is private (or the caller gave up the logits with inplace_grad);
        # it bumps the saved tensor's version, so a second backward (retain_graph) raises.
        (torch.ops.kprof.cross_entropy_bwd if via_custom_op() else _ce_bwd_eager)(grad, grad_output)
        return grad, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# 5. Public function
# ----------------------------------------------------------------------------------------------


def _check_options(label_smoothing: float, reduction: str, z_loss: float, softcap: float | None) -> None:
    if reduction not in _REDUCTIONS:
        raise KprofError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise KprofError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not math.isfinite(z_loss) or z_loss < 0.0:
        raise KprofError(f"z_loss must be a finite coefficient >= 0 (PaLM uses 1e-4), got {z_loss}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0.0):
        raise KprofError(f"softcap must be None or a positive number (Gemma 2 uses 30.0), got {softcap}")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    inplace_grad: bool = False,
) -> torch.Tensor:
    """Cross-entropy of `logits` [N, V] (fp32/fp16/bf16) against class indices `target` [N]
    (int64 or int32), forward and backward in one kernel.

    Matches `F.cross_entropy(logits.float(), target, ignore_index=, label_smoothing=,
    reduction=)` cast to the logits' dtype (as torch returns it): fp32 accumulation, mean over
    non-ignored targets (nan if all are ignored, like torch), label smoothing as torch defines
    it. Extras:
      z_loss:  adds z_loss * logsumexp(logits)^2 per non-ignored token, reduced the same way (PaLM).
      softcap: logits -> softcap * tanh(logits / softcap) before everything else (Gemma 2).
      inplace_grad: write the gradient into the logits' buffer instead of a new [N, V] buffer
        (saves N*V*itemsize bytes, as Liger does by default). The logits' values are destroyed;
        only use it when nothing reads them afterwards. If an autograd node saved them, its
        backward raises torch's "modified by an inplace operation" error rather than computing
        garbage. Needs unit stride along V and non-overlapping rows (otherwise a separate
        buffer is used).

    The gradient is computed in the forward (only when `logits` requires grad), so the backward
    is free for `loss.backward()` (grad_output == 1, skipped on the device) and costs one
    read+write of the gradient otherwise (e.g. `(loss / accum_steps).backward()`, or
    reduction='none'). The backward can run once (no retain_graph double backward).
    """
    _check_options(label_smoothing, reduction, z_loss, softcap)
    _check_logits_target(logits, target, ignore_index)
    if not use_triton(logits):
        warn_fallback("cross_entropy", f"no Triton on {logits.device} (set TRITON_INTERPRET=1 for CPU)")
        return cross_entropy_reference(
            logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction, z_loss=z_loss, softcap=softcap, inplace_grad=inplace_grad,
        )
    need_grad = logits.requires_grad and torch.is_grad_enabled()
    return _CrossEntropyFunction.apply(
        logits, target, int(ignore_index), float(label_smoothing), reduction, float(z_loss), softcap, inplace_grad, need_grad
    )


# ----------------------------------------------------------------------------------------------
# 6. nn.Module
# ----------------------------------------------------------------------------------------------


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for `nn.CrossEntropyLoss` on [N, V] logits (no class weights), plus z_loss and
    softcap. See `cross_entropy`."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        inplace_grad: bool = False,
    ):
        super().__init__()
        _check_options(label_smoothing, reduction, z_loss, softcap)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.inplace_grad = inplace_grad

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            logits, target, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, z_loss=self.z_loss, softcap=self.softcap, inplace_grad=self.inplace_grad,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, softcap={self.softcap}, inplace_grad={self.inplace_grad}"
        )


# ----------------------------------------------------------------------------------------------
# 7. Reference
# ----------------------------------------------------------------------------------------------


def cross_entropy_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    inplace_grad: bool = False,  # accepted for signature parity; the reference never writes in place
) -> torch.Tensor:
    """Pure PyTorch: F.cross_entropy on logits upcast to at least fp32 (after the softcap), plus
    the z-loss term, cast back to the logits' dtype."""
    _check_options(label_smoothing, reduction, z_loss, softcap)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, target.long(), ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        valid = target != ignore_index
        zl = z_loss * torch.logsumexp(z, dim=-1).pow(2) * valid
        zl = _reduce(zl, target, ignore_index, reduction)
        loss = loss + zl
    return loss.to(logits.dtype)


# ----------------------------------------------------------------------------------------------
# 8. Registry
# ----------------------------------------------------------------------------------------------


# FLOPs per logit, counted from the kernel: pass 1 max, sub, exp, add (4); pass 2 sub, exp, mul,
# sub, select, (4-5). Transcendentals count as one FLOP each. Softcap adds ~8 per pass.
_FWD_FLOPS_PER_LOGIT = 9


def _ce_cost(n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16, target_dtype: torch.dtype = torch.int64) -> dict:
    e = dtype.itemsize
    nv = n_rows * n_cols
    # Forward: read the logits once (+ targets), write the gradient once (+ fp32 per-row losses).
    fwd = Cost(flops=_FWD_FLOPS_PER_LOGIT * nv, bytes=nv * e + n_rows * target_dtype.itemsize + nv * e + 4 * n_rows)
    # Backward: minimal cost is zero, `loss.backward()` passes grad_output = 1 and the scaling is
    # skipped on the device. With grad_output != 1 (loss / accum_steps, reduction='none') it is
    # one multiply per logit over a read and a write of the gradient: nv FLOPs, 2 * nv * e bytes.
    return {"fwd": fwd, "bwd": Cost(flops=0.0, bytes=0.0)}


def _op_cost_fwd(metas) -> Cost:
    logits, target = metas[0], metas[1]
    return _ce_cost(logits.shape[0], logits.shape[1], logits.dtype, target.dtype)["fwd"]


def _op_cost_bwd(metas) -> Cost:
    # In-place scaling of a stored gradient by grad_output. Its launch is in every trace, but it
    # moves data only when grad_output != 1, which the metas cannot tell; listed at the minimal
    # (skipped) cost, like `_ce_cost`'s backward.
    return Cost(flops=0.0, bytes=0.0)


SPEC = register(
    KernelSpec(
        name="cross_entropy",
        replaces="F.cross_entropy(logits.float(), target) and its backward (log_softmax + nll_loss, fp32 upcast)",
        dtypes=_DTYPES,
        limits=(
            "logits [N, V] with V < 2^31, any N; rows over 16384 columns: on sm_90+ one read per logit "
            "(cluster kernel, 16-byte aligned rows, V <= 262144 half / 131072 fp32 outside the part-filled "
            "range, no softcap), else "
            "streamed in blocks (two reads, the second meant to hit L2); no class weights"
        ),
        deterministic=True,  # no atomics: each row is reduced in a fixed order (one program, or one cluster)
        fn=cross_entropy,
        module=CrossEntropyLoss,
        reference=cross_entropy_reference,
        cost=_ce_cost,
        op_costs={
            "kprof::cross_entropy_fwd": _op_cost_fwd,
            "kprof::cross_entropy_fwd_inplace": _op_cost_fwd,
            "kprof::cross_entropy_bwd": _op_cost_bwd,
        },
    )
)

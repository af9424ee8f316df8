"""LayerNorm over the last dim, with or without weight and bias, forward and backward.

Matches `F.layer_norm(x, (N,), weight, bias, eps)`: mean and biased variance in fp32, output
in x's dtype (the weight and bias may be another float dtype, as under autocast).

Why: x of 16384 x 4096 bf16 must move 268 MB forward (63 us floor at the H200's 4.27 TB/s)
and 403 MB backward (94 us); kprof measures 68.7 us forward and 185.5 us fwd+bwd on the H200
(targets 70 / 200 us; CUDA-graph time per call, the backward kernel 108.4 us of it). As in
rms_norm, the backward is one pass: each program of a persistent grid walks a contiguous chunk
of rows, keeps its dweight and dbias partial sums in registers (fp32 for half inputs, fp64 for
fp32 ones) and writes them once; one small kernel (rms_norm.sum_partials) sums the partials of
both in fp64 and writes them in the parameters' dtypes. No atomics: bitwise deterministic on a
given device. The forward saves the mean as an fp32 hi/lo pair so the backward's row reduction
has two operands, not three. The launch configuration (`RowConfig`, the persistent grid) is
shared with rms_norm; rows up to MAX_FUSED_N are held in registers (x read once), wider rows loop
over column tiles and read x three times in the forward (mean, variance, output: a corrected
two-pass variance, for accuracy when |mean| >> std) and twice in the backward.
"""

import dataclasses
import functools
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from kprof.errors import KprofError
from kprof.kernels.common import (
    acc_zeros,
    cast_rtne,
    FP_FUSION,
    INTERPRETED,
    cdiv,
    kernel_op,
    launch,
    new_out,
    num_warps,
    numel,
    require_triton,
    rows_and_stride,
    rows_cols,
    sm_count,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register
from kprof.kernels.rms_norm import (
    MAX_FUSED_N,
    RowConfig,
    backward_plan,
    sum_partials,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _row_sums2(a, b, TREE_EMU: tl.constexpr):
    """(sum(a, axis=1), sum(b, axis=1)) as one two-operand reduction (one shuffle + shared-memory
    round for both), or two tl.sum under the interpreter (TREE_EMU: see the forward)."""
    if TREE_EMU:
        sa, sb = tl.sum(a, axis=1), tl.sum(b, axis=1)
    else:
        sa, sb = tl.reduce((a, b), 1, _add2)
    return sa, sb


@triton.jit
def _store_mean_pair(MEAN, rows, row_mask, n_rows, mean0, corr):
    """Store the row means as an fp32 pair: MEAN[rows] = hi = fp32(mean0 + corr), the rounded
    mean, and MEAN[n_rows + rows] = lo with hi + lo == mean0 + corr exactly (Knuth's TwoSum:
    no condition on the magnitudes, no multiply for FMA contraction to touch). The backward's
    x - hi - lo is then as accurate as the forward's (x - mean0) - corr, where x - hi alone is
    off by up to ulp(hi) / 2 (3e-5 at |mean| 1000, 1.5e-5 of a std of 2)."""
    hi = mean0 + corr
    b = hi - mean0
    lo = (mean0 - (hi - b)) + (corr - b)
    tl.store(MEAN + rows, hi, mask=row_mask)
    tl.store(MEAN + n_rows + rows, lo, mask=row_mask)


@triton.jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    stride_x, stride_y,
    n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LOOP: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,  # interpreter only: see common.cast_rtne
    TREE_EMU: tl.constexpr,  # interpreter only: the two-operand reduction as two tl.sum (below)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y = (x - mean) * rstd [* w] [+ b] for BLOCK_M rows per program, all in fp32; the mean
    (an fp32 hi/lo pair: MEAN[0:n_rows], MEAN[n_rows:2 n_rows], _store_mean_pair) and rstd (fp32)
    of each row are saved for the backward (the launcher's stats tensor [3, n_rows]; RSTD = its
    third row)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2^31 elements
    x_ptr = X + rows64[:, None] * stride_x
    y_ptr = Y + rows64[:, None] * stride_y

    if not LOOP:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)  # padding must not enter the variance
        # Corrected two-pass (Chan, Golub & LeVeque 1983): the fp32 sum behind `mean` is off by
        # ~1e-7 * |mean| * log2(N) (1.2e-4 at mean 1000, N 300: 6e-5 of a std of 2, over the
        # fp32 tolerance); the residuals' sum recovers that error almost exactly.
        # corr and E[xc^2] in one two-operand reduction (one shuffle + shared-memory round instead
        # of two in sequence; 68.1 -> 67.3 us on the H200 at 16384 x 4096 bf16): var = E[xc^2] -
        # corr^2, exact in real arithmetic, and corr^2 ~ (1e-7 |mean|)^2 << var, so the
        # subtraction loses nothing.
        # TREE_EMU: the interpreter (3.9) runs a combine_fn reduction element by element in
        # sequence (tl.sum is numpy's pairwise sum): at 1823 x 781 fp32 that made this rstd 5x
        # less accurate on the CPU than the GPU's tree (2.2e-7 vs 2.3e-8 relative, emulated), and
        # test_fp32_dweight_on_the_h200_grid failed there (1.04 of the fp32 tolerance).
        s_xc, s_xc2 = _row_sums2(xc, xc * xc, TREE_EMU)
        corr = s_xc / n_cols
        xc = tl.where(mask, xc - corr[:, None], 0.0)
        rstd = tl.rsqrt(tl.where(row_mask, s_xc2 / n_cols - corr * corr + eps, 1.0))  # padding rows: finite
        _store_mean_pair(MEAN, rows, row_mask, n_rows, mean, corr)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        y = xc * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + cols[None, :], cast_rtne(y, Y.dtype.element_ty, EMULATE_RTNE), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):  # pass 1: mean
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            acc += tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=1) / n_cols
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_sq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):  # pass 2: variance about the mean
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc
            acc_sq += xc * xc
        # Corrected two-pass, as in the in-register branch: var = E[xc²] - corr², corr << std.
        corr = tl.sum(acc, axis=1) / n_cols
        var = tl.sum(acc_sq, axis=1) / n_cols - corr * corr
        rstd = tl.rsqrt(tl.where(row_mask, var + eps, 1.0))  # padding rows: finite, never stored
        _store_mean_pair(MEAN, rows, row_mask, n_rows, mean, corr)
        tl.store(RSTD + rows, rstd, mask=row_mask)
        for start in range(0, n_cols, BLOCK_N):  # pass 3: output
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None] - corr[:, None]) * rstd[:, None]  # mean and corr kept apart
            if HAS_WEIGHT:
                y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            if HAS_BIAS:
                y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + cols[None, :], cast_rtne(y, Y.dtype.element_ty, EMULATE_RTNE), mask=mask)


@triton.jit
def _load_rows(DY, X, stride_dy, stride_x, row0, row_end, cols, col_mask, BLOCK_M: tl.constexpr):
    """dy and x of rows [row0, row0 + BLOCK_M) (those before row_end), in their own dtype."""
    rows = row0 + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2^31 elements
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    return dy, x


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, C,
    stride_dy, stride_x, stride_dx,
    n_rows, n_cols, rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    LOOP: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
    ACC_F64: tl.constexpr,  # dw/db partials in fp64 (fp32 inputs) or fp32 (half inputs)
    TREE_EMU: tl.constexpr,  # interpreter only: multi-operand reductions as separate tl.sum (see the forward)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward over a contiguous chunk of rows per program (persistent grid).

    With x_hat = (x - mean) * rstd and g = dy * w (dy without a weight):
        dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
        dw = sum over rows of dy * x_hat,  db = sum over rows of dy
    (dw, db: this program's partial rows in DW_PART[pid, :], DB_PART[pid, :]). MEAN is the
    forward's pair: mean = MEAN[rows] + MEAN[n_rows + rows] (_store_mean_pair).
    """
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)

    if not LOOP:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = acc_zeros(BLOCK_N, ACC_F64)
        db_acc = acc_zeros(BLOCK_N, ACC_F64)
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            dy, x = _load_rows(DY, X, stride_dy, stride_x, row0, row_end, cols, col_mask, BLOCK_M)
            dy, x = dy.to(tl.float32), x.to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            # x - hi - lo is the forward's x - mean to within one rounding of the difference, so
            # x_hat needs no re-centering sum: two row sums, not three. Padding: g = 0 on masked
            # columns (no dx stored, no dw/db), x_hat = 0 on masked rows (rstd = 0).
            lo = tl.load(MEAN + n_rows + rows, mask=row_mask, other=0.0)
            x_hat = (x - mean[:, None] - lo[:, None]) * rstd[:, None]
            s_gxh, s_g = _row_sums2(g * x_hat, g, TREE_EMU)
            c2 = s_g / n_cols
            c1 = s_gxh / n_cols
            dx = (g - c2[:, None] - x_hat * c1[:, None]) * rstd[:, None]
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], cast_rtne(dx, DX.dtype.element_ty, EMULATE_RTNE), mask=mask)
            # (Accumulating dw/db before the reductions, as rms_norm does, made ptxas spill 8 B
            # per thread here at 4096 columns, bf16, sm_90: kept after.)
            if COMPUTE_DW:
                dw_acc += tl.sum((dy * x_hat).to(dw_acc.dtype), axis=0)
            if COMPUTE_DB:
                db_acc += tl.sum(dy.to(db_acc.dtype), axis=0)
        if COMPUTE_DW:
            tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_mask)
        if COMPUTE_DB:
            tl.store(DB_PART + pid * n_cols + cols, db_acc, mask=col_mask)
    else:
        # Phase A: per row, c1 = mean(g * x_hat) and c2 = mean(g) into the fp32 scratch
        # C = [c1, c2] (n_rows each), one pass over the row: with xc = x - hi - lo,
        # x_hat = xc * rstd and c1 = rstd * mean(g * xc).
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            lo = tl.load(MEAN + n_rows + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < n_cols
                dy, x = _load_rows(DY, X, stride_dy, stride_x, row0, row_end, cols, col_mask, BLOCK_M)
                dy, x = dy.to(tl.float32), x.to(tl.float32)
                xc = x - mean[:, None] - lo[:, None]  # padding: g = 0 there
                if HAS_WEIGHT:
                    g = dy * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                else:
                    g = dy
                acc1 += g * xc
                acc2 += g
            c2 = tl.sum(acc2, axis=1) / n_cols
            c1 = rstd * (tl.sum(acc1, axis=1) / n_cols)
            tl.store(C + rows, c1, mask=row_mask)
            tl.store(C + n_rows + rows, c2, mask=row_mask)
        # C was written by other threads of this program: make it visible before reading.
        tl.debug_barrier()
        # Phase B: column tile outer, rows inner, so a tile's dw/db partials stay in registers.
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            dw_acc = acc_zeros(BLOCK_N, ACC_F64)
            db_acc = acc_zeros(BLOCK_N, ACC_F64)
            for row0 in range(row_start, row_end, BLOCK_M):
                rows = row0 + tl.arange(0, BLOCK_M)
                row_mask = rows < row_end
                rows64 = rows.to(tl.int64)
                mask = row_mask[:, None] & col_mask[None, :]
                dy, x = _load_rows(DY, X, stride_dy, stride_x, row0, row_end, cols, col_mask, BLOCK_M)
                dy, x = dy.to(tl.float32), x.to(tl.float32)
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                c1 = tl.load(C + rows, mask=row_mask, other=0.0)
                c2 = tl.load(C + n_rows + rows, mask=row_mask, other=0.0)
                lo = tl.load(MEAN + n_rows + rows, mask=row_mask, other=0.0)
                x_hat = tl.where(mask, (x - mean[:, None] - lo[:, None]) * rstd[:, None], 0.0)
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                else:
                    g = dy
                dx = (g - c2[:, None] - x_hat * c1[:, None]) * rstd[:, None]
                tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], cast_rtne(dx, DX.dtype.element_ty, EMULATE_RTNE), mask=mask)
                if COMPUTE_DW:
                    dw_acc += tl.sum((dy * x_hat).to(dw_acc.dtype), axis=0)
                if COMPUTE_DB:
                    db_acc += tl.sum(dy.to(db_acc.dtype), axis=0)
            if COMPUTE_DW:
                tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_mask)
            if COMPUTE_DB:
                tl.store(DB_PART + pid * n_cols + cols, db_acc, mask=col_mask)


# --------------------------------------------------------------------------------------------
# Checks and host launchers
# --------------------------------------------------------------------------------------------


# The backward's launch: 8192 elements per block (2 rows of 4096) at 8 warps under a 128-register
# cap (ptxas .maxnreg), so that 2 programs of 8 warps share an SM (65536 / 256 threads / 2): the
# fastest measured on the H200 at 16384 x 4096 bf16, fwd+bwd 184.5 us (backward kernel 108.4 us)
# against 197.5 us at 4 warps uncapped (255 registers), with 8 B of spill. The cap applies to
# bf16/fp16 inputs only: fp32 ones hold twice the bytes per element and fp64 weight-grad
# partials, and were not measured under a cap.
BWD_BLOCK_ELEMS = 8192
BWD_MAX_WARPS = 8
BWD_MAXNREG = 128


def _check(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> None:
    if not isinstance(x, torch.Tensor):
        raise KprofError(f"layer_norm: x must be a tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise KprofError("layer_norm: x must have at least one dimension (the normalized last dim); got a scalar")
    if x.dtype not in _DTYPES:
        raise KprofError(f"layer_norm: supports float32/float16/bfloat16, got x {x.dtype}; cast the input first")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.dtype not in _DTYPES:
            raise KprofError(f"layer_norm: supports float32/float16/bfloat16, got {name} {p.dtype}")
        if p.dim() != 1 or p.shape[0] != x.shape[-1]:
            raise KprofError(
                f"layer_norm: {name} must have shape ({x.shape[-1]},) to match x's last dim (only the last dim is "
                f"normalized); got {tuple(p.shape)}"
            )
        if p.device != x.device:
            raise KprofError(f"layer_norm: x is on {x.device} but {name} is on {p.device}; move them together")


@functools.lru_cache(maxsize=256)
def _forward_config(n_cols: int) -> RowConfig:
    """RowConfig.forward with LayerNorm's own warp count: ~32 elements a thread (4 warps for a
    4096-wide row), where RMSNorm takes ~16 (8 warps): 73.3 -> 67.3 us from 8 to 4 warps on the
    H200 at 16384 x 4096 bf16 (16 warps 93.7)."""
    cfg = RowConfig.forward(n_cols)
    if cfg.loop:
        return cfg
    return dataclasses.replace(cfg, num_warps=num_warps(cfg.block_m * cfg.block_n, per_thread=32))


def _launch_fwd(x, weight, bias, eps):
    """(y, stats): stats is fp32 [3, rows] (the op views it as [3, *x.shape[:-1]]), per row the
    mean as a (hi, lo) pair (_store_mean_pair) and rstd. One tensor, one allocation: the host's
    cost per call is what the eager wall time is made of (see common.via_custom_op). As
    rms_norm's launchers: contiguous tensors passed as they are, plans cached per shape."""
    n_cols = x.shape[-1]
    y = new_out(x)
    n_rows = x.numel() // n_cols if n_cols else numel(x.shape[:-1])
    stats = torch.empty(3, n_rows, dtype=torch.float32, device=x.device)  # sizes as ints (see new_out); the op views it
    if n_rows == 0 or n_cols == 0:
        return y, stats.fill_(math.nan)  # moments of an empty row are undefined
    x2, sx = rows_and_stride(x, n_cols)
    cfg = _forward_config(n_cols)
    w = weight.contiguous() if weight is not None else x2  # dummy pointer when absent
    b = bias.contiguous() if bias is not None else x2
    launch(_layer_norm_fwd_kernel, (cdiv(n_rows, cfg.block_m),),
        x2, w, b, y, stats, stats[2],
        sx, n_cols,
        n_rows, n_cols, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, LOOP=cfg.loop,
        EMULATE_RTNE=INTERPRETED, TREE_EMU=INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        **FP_FUSION,
    )
    return y, stats


def _launch_bwd(dy, x, weight, stats, dw_dtype, db_dtype):
    """(dx, dweight, dbias): dweight in `dw_dtype` and dbias in `db_dtype`, shape (N,), or fp32
    of shape (0,) where that dtype is None (not asked for)."""
    n_cols = x.shape[-1]
    dx = new_out(x)
    compute_dw, compute_db = dw_dtype is not None, db_dtype is not None
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        return dx, *(torch.zeros(n_cols if dt is not None else 0, dtype=dt or torch.float32, device=x.device)
                     for dt in (dw_dtype, db_dtype))
    dy2, sdy = rows_and_stride(dy, n_cols)
    x2, sx = rows_and_stride(x, n_cols)
    plan = backward_plan(n_rows, n_cols, x.dtype, x.device, sm_count(x.device), BWD_BLOCK_ELEMS, BWD_MAX_WARPS)
    cfg, n_programs = plan.cfg, plan.n_programs
    dw_part = torch.empty(n_programs if compute_dw else 1, n_cols, dtype=plan.part_dtype, device=x.device)
    db_part = torch.empty(n_programs if compute_db else 1, n_cols, dtype=plan.part_dtype, device=x.device)
    # Per-row scratch (c1, c2) for the looped path only; otherwise never touched, and stats (fp32
    # too) stands in, as in rms_norm.
    c = torch.empty(2 * n_rows, dtype=torch.float32, device=x.device) if cfg.loop else stats
    launch(_layer_norm_bwd_kernel, (n_programs,),
        dy2, x2, weight.contiguous() if weight is not None else x2, stats, stats[2],
        dx, dw_part, db_part, c,
        sdy, sx, n_cols,
        n_rows, n_cols, plan.rows_per_program,
        HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, LOOP=cfg.loop,
        EMULATE_RTNE=INTERPRETED, ACC_F64=plan.acc_f64,
        TREE_EMU=INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        maxnreg=BWD_MAXNREG if x.element_size() == 2 else None,
        **FP_FUSION,
    )
    # Second stage of the dw/db reductions (one launch for both): fixed order over the
    # n_programs partial rows, deterministic; written in the parameters' dtypes.
    asked = [(p, dt) for p, dt in ((dw_part, dw_dtype), (db_part, db_dtype)) if dt is not None]
    sums = iter(sum_partials(*asked) if asked else [])
    # A skipped gradient is an empty fp32 tensor of its own (custom-op outputs may not alias).
    return dx, *(next(sums) if dt is not None else x.new_zeros(0, dtype=torch.float32) for dt in (dw_dtype, db_dtype))


# --------------------------------------------------------------------------------------------
# torch.library custom ops
# --------------------------------------------------------------------------------------------


@kernel_op("kprof::layer_norm_fwd")
def _layer_norm_fwd_op(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, stats): stats fp32 [3, *x.shape[:-1]] = (mean hi, mean lo, rstd) per row."""
    require_triton(x, "layer_norm")
    y, stats = _launch_fwd(x, weight, bias, eps)
    return y, stats.view(3, *x.shape[:-1])


@_layer_norm_fwd_op.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape), x.new_empty((3, *x.shape[:-1]), dtype=torch.float32)


@kernel_op("kprof::layer_norm_bwd")
def _layer_norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    stats: torch.Tensor,
    dw_dtype: Optional[torch.dtype],
    db_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias); dweight and dbias in `dw_dtype` / `db_dtype` (the
    parameters' dtypes: the second-stage kernel writes them, no cast kernels after), shape (N,);
    a None dtype skips that gradient and returns an fp32 tensor of shape (0,)."""
    require_triton(x, "layer_norm backward")
    return _launch_bwd(dy, x, weight, stats, dw_dtype, db_dtype)


@_layer_norm_bwd_op.register_fake
def _(dy, x, weight, stats, dw_dtype, db_dtype):
    n = x.shape[-1]
    return (
        x.new_empty(x.shape),
        x.new_empty((n,) if dw_dtype is not None else (0,), dtype=dw_dtype or torch.float32),
        x.new_empty((n,) if db_dtype is not None else (0,), dtype=db_dtype or torch.float32),
    )


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class _LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        fwd = torch.ops.kprof.layer_norm_fwd if via_custom_op() else _launch_fwd  # see common.via_custom_op
        y, stats = fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, stats)
        ctx.w_dtype = weight.dtype if weight is not None else None
        ctx.b_dtype = bias.dtype if bias is not None else None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        dw_dtype = ctx.w_dtype if weight is not None and ctx.needs_input_grad[1] else None
        db_dtype = ctx.b_dtype if ctx.needs_input_grad[2] else None  # b_dtype is None without a bias
        bwd = torch.ops.kprof.layer_norm_bwd if via_custom_op() else _launch_bwd
        dx, dw, db = bwd(dy, x, weight, stats, dw_dtype, db_dtype)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dw if dw_dtype is not None else None,
            db if db_dtype is not None else None,
            None,
        )


# --------------------------------------------------------------------------------------------
# Public function and module
# --------------------------------------------------------------------------------------------


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of `x` (..., N); weight and bias of shape (N,) or None.

    Matches `F.layer_norm(x, (N,), weight, bias, eps)`: mean and biased variance in fp32 (a
    corrected two-pass, not E[x²] - E[x]²: accurate when |mean| >> std, where torch's own fp32
    kernel is off by ~3e-5), affine in fp32, one cast to x's dtype. dtypes: float32,
    float16, bfloat16; weight and bias may differ from x (the output keeps x's dtype, the
    gradients their parameters' dtypes). Any leading shape and strides; rows of any width.
    """
    _check(x, weight, bias)
    if use_triton(x):
        return _LayerNormFunction.apply(x, weight, bias, float(eps))
    warn_fallback("layer_norm", f"no Triton for tensors on {x.device}")
    return layer_norm_reference(x, weight, bias, eps)


class LayerNorm(nn.LayerNorm):
    """Drop-in for `nn.LayerNorm` over the last dim: same constructor, parameters and
    state_dict (weight, bias), forward through `layer_norm`. Only a single normalized
    dim is supported (every LLM's LayerNorm); others raise."""

    def __init__(
        self,
        normalized_shape: Union[int, tuple[int, ...], list[int]],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise KprofError(
                f"LayerNorm: kprof normalizes over the last dim only; got normalized_shape={shape}. "
                "Reshape so the normalized dims are one, or keep nn.LayerNorm for this module."
            )
        super().__init__(shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != self.normalized_shape:
            raise KprofError(
                f"LayerNorm: expected input with last dim {self.normalized_shape[0]}, got shape {tuple(x.shape)}"
            )
        return layer_norm(x, self.weight, self.bias, self.eps)


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def layer_norm_reference(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """F.layer_norm computed in fp32 (fp64 for fp64 inputs), cast to x's dtype: what PyTorch's
    CUDA kernel does for half inputs, including mixed parameter dtypes."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    return F.layer_norm(x.to(acc), (x.shape[-1],), w, b, eps).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Cost model and registry
# --------------------------------------------------------------------------------------------

# FLOPs per element, counted from the kernels above:
#   forward:  +sum (1), x - mean (1), +sum and - corr (2), xc*xc and +sum (2), *rstd (1),
#             *w (1), +b (1)                                                             = 9
#   backward: x - hi - lo, *rstd (3), g = dy*w (1), g*x_hat and +sum (2), +sum g (1),
#             dx = (g - c2 - x_hat*c1)*rstd (4), dw += dy*x_hat (2), db += dy (1)         = 14
# (the affine terms are counted even without weight/bias: an upper bound by 2-3 FLOP).
_FWD_FLOPS, _BWD_FLOPS = 9, 14


def layer_norm_cost(
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype,
    weight_dtype: Optional[torch.dtype] = None,
    has_weight: bool = True,
    has_bias: bool = True,
) -> dict[str, Cost]:
    """Minimal bytes (each input read once, each output written once) and FLOPs."""
    elems = n_rows * n_cols
    xs = dtype.itemsize
    params = (int(has_weight) + int(has_bias)) * n_cols * (weight_dtype or dtype).itemsize
    stats = 3 * n_rows * 4  # the mean pair (hi, lo) and rstd, fp32
    fwd = Cost(_FWD_FLOPS * elems, 2 * elems * xs + params + stats)  # x, w, b -> y, stats
    w_read = n_cols * (weight_dtype or dtype).itemsize if has_weight else 0
    bwd = Cost(_BWD_FLOPS * elems, 3 * elems * xs + w_read + stats + params)  # dy, x, w, stats -> dx, dw, db
    return {"fwd": fwd, "bwd": bwd}


def _is_param(m: Optional[TensorMeta], n_cols: int) -> bool:
    return m is not None and tuple(m.shape) == (n_cols,)


def _fwd_op_cost(metas: list[TensorMeta]) -> Cost:
    # (x, weight?, bias?): a None parameter may be absent from the trace or recorded with an
    # empty shape, so parameters are recognized by their shape (N,).
    x = metas[0]
    n_rows, n_cols = rows_cols(x.shape)
    params = [m for m in metas[1:3] if _is_param(m, n_cols)]
    elems = n_rows * n_cols
    nbytes = 2 * elems * x.dtype.itemsize + sum(n_cols * m.dtype.itemsize for m in params) + 3 * n_rows * 4
    return Cost((_FWD_FLOPS - 2 + len(params)) * elems, nbytes)


def _bwd_op_cost(metas: list[TensorMeta]) -> Cost:
    # (dy, x, weight?, stats): stats ([3, ...]: the mean pair and rstd) is the last tensor.
    # Whether dbias is computed is a dtype argument, not a tensor in the trace: assumed present
    # with the weight (the nn.LayerNorm default).
    x = metas[1]
    n_rows, n_cols = rows_cols(x.shape)
    w = metas[2] if len(metas) >= 4 and _is_param(metas[2], n_cols) else None
    c = layer_norm_cost(n_rows, n_cols, x.dtype, w.dtype if w is not None else None, w is not None, w is not None)
    return c["bwd"]


SPEC = register(
    KernelSpec(
        name="layer_norm",
        replaces="F.layer_norm / nn.LayerNorm over the last dim (native kernel; fused here fwd and one-pass bwd)",
        dtypes=_DTYPES,
        limits=(
            f"last dim only, any width: rows up to {MAX_FUSED_N} held in registers (x read once); wider rows loop "
            "over column tiles (x read 3x fwd, 2x bwd, mostly from L2)"
        ),
        deterministic=True,  # no atomics; dw/db partials reduced in a fixed order
        fn=layer_norm,
        module=LayerNorm,
        reference=layer_norm_reference,
        cost=layer_norm_cost,
        op_costs={"kprof::layer_norm_fwd": _fwd_op_cost, "kprof::layer_norm_bwd": _bwd_op_cost},
    )
)

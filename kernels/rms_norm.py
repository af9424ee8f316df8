"""RMSNorm (Llama and Gemma casting) and fused residual-add + RMSNorm, forward and backward.

Replaces the eager HF formulation

    h = x.to(fp32); h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)                      # LlamaRMSNorm  ("llama" casting)
    y = (h * (1.0 + weight.float())).type_as(x)     # GemmaRMSNorm  ("gemma" casting, offset=1)

which launches ~7 kernels forward and ~10 backward, each a full pass over the activations.
Here the forward is one kernel and the backward one kernel plus a tiny reduction.

Why: x of 16384 x 4096 bf16 (128 MiB) must move 268 MB forward (read x, write y: 63 us at the
H200's 4.27 TB/s copy bandwidth) and 403 MB backward (read x, dy, write dx: 94 us), a 157 us
fwd+bwd floor; Liger 0.6 takes 70 / 680 us and torch.compile 132 / 739 us. kprof measures 66 us
forward and 175 us fwd+bwd on the H200. The backward reaches one pass because dweight is
accumulated per program in registers over a contiguous chunk of rows (a persistent grid of
BWD_PROGRAMS_PER_SM programs per SM), and the [n_programs, N] partials are summed afterwards by one
small kernel in a fixed order (`sum_partials`, shared with layer_norm): no atomics, so it is bitwise
deterministic on a given device. Partials are fp32 for half inputs (per-program sums over ~62 rows
stay ~1e-5 relative; fp64 ones cost 219 vs 182 us) and fp64 for fp32 inputs (fp32 ones failed fp32
dweight against the fp64 reference at 16384x4096); the second stage adds them in fp64 and rounds
once, so dweight is the exact sum of the kernel's own fp32 terms (tests check this). Rows up to
MAX_FUSED_N columns are held whole in registers (x read once); wider rows loop over LOOP_BLOCK_N
tiles and read x twice per pass (the second read mostly from L2).

Layers, in order: Triton kernels, launchers, torch.library custom ops, autograd.Functions,
public functions, the `RMSNorm` module, the PyTorch references, the registry entries.
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Optional

import torch
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
    next_power_of_2,
    new_out,
    num_warps,
    numel,
    persistent_programs,
    require_triton,
    row_tile,
    rows_and_stride,
    rows_cols,
    sm_count,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CASTINGS = ("llama", "gemma")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD,
    stride_x, stride_r, stride_y, stride_s,
    n_rows, n_cols, eps, offset,
    HAS_RESIDUAL: tl.constexpr,  # s = x + r (rounded to x's dtype) is normalized and stored
    GEMMA: tl.constexpr,  # gemma: y = (x_hat * (w + offset)) cast once; llama: cast x_hat first
    LOOP: tl.constexpr,  # row wider than one block: loop over column tiles
    EMULATE_RTNE: tl.constexpr,  # interpreter only: see common.cast_rtne
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward of BLOCK_M rows per program. Arithmetic in fp32 (the interpreter, and accuracy,
    need the upcast before any arithmetic); rstd (fp32, one per row) is saved for the backward."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)  # row * stride overflows int32 past 2^31 elements
    x_ptr = X + rows64[:, None] * stride_x
    r_ptr = R + rows64[:, None] * stride_r
    y_ptr = Y + rows64[:, None] * stride_y
    s_ptr = S + rows64[:, None] * stride_s

    if not LOOP:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = cast_rtne(x + r, S.dtype.element_ty, EMULATE_RTNE)  # HF adds in the activation dtype
            tl.store(s_ptr + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.where(row_mask, tl.sum(x * x, axis=1) / n_cols + eps, 1.0))  # padding rows: finite, never stored
        tl.store(RSTD + rows, rstd, mask=row_mask)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        x_hat = x * rstd[:, None]
        if not GEMMA:
            x_hat = cast_rtne(x_hat, X.dtype.element_ty, EMULATE_RTNE).to(tl.float32)
        tl.store(y_ptr + cols[None, :], cast_rtne(x_hat * w[None, :], Y.dtype.element_ty, EMULATE_RTNE), mask=mask)
    else:
        # Pass 1: sum of squares tile by tile (and the residual sum, stored once).
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < n_cols)[None, :]
            x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                s = cast_rtne(x + r, S.dtype.element_ty, EMULATE_RTNE)
                tl.store(s_ptr + cols[None, :], s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.where(row_mask, tl.sum(acc, axis=1) / n_cols + eps, 1.0))  # padding rows: finite, never stored
        tl.store(RSTD + rows, rstd, mask=row_mask)
        # Pass 2: normalize. The residual sum is recomputed from x and r (same rounding, so
        # the same value) rather than re-read from S, which would need a barrier between
        # threads of the program.
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = cast_rtne(x + r, S.dtype.element_ty, EMULATE_RTNE).to(tl.float32)
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
            x_hat = x * rstd[:, None]
            if not GEMMA:
                x_hat = cast_rtne(x_hat, X.dtype.element_ty, EMULATE_RTNE).to(tl.float32)
            tl.store(y_ptr + cols[None, :], cast_rtne(x_hat * w[None, :], Y.dtype.element_ty, EMULATE_RTNE), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DS, DX, DW_PART, C,
    stride_dy, stride_x, stride_ds, stride_dx,
    n_rows, n_cols, offset, rows_per_program,
    HAS_DS: tl.constexpr,  # add the gradient of the residual-sum output (fused add variant)
    LOOP: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
    ACC_F64: tl.constexpr,  # dw partials accumulated in fp64 (fp32 inputs) or fp32 (half inputs)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward over a contiguous chunk of rows per program (persistent grid).

    With x_hat = x * rstd and g = dy * (w + offset) (the same in both casting modes: the cast
    of x_hat in llama mode has gradient 1, as in autograd):
        dx = rstd * (g - x_hat * mean(g * x_hat))  [+ ds]
        dw = sum over rows of dy * x_hat  -> this program's partial row in DW_PART[pid, :]
    dw uses the fp32 x_hat (HF's autograd uses the x_hat rounded to x's dtype; the fp32 one is
    the more accurate of the two and agrees with an fp32 reference to one final rounding).
    """
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)

    if not LOOP:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw_acc = acc_zeros(BLOCK_N, ACC_F64)
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_hat = x * rstd[:, None]
            # dw first, so dy is dead before the row reduction: shorter live ranges, 128 -> 115
            # registers per thread at 4096 columns (sm_90, ptxas of Triton 3.9; 128 is the cap
            # at 16 warps). At 16384 columns it still spills ~200 B per thread.
            dw_acc += tl.sum((dy * x_hat).to(dw_acc.dtype), axis=0)  # masked rows/cols load 0, contribute 0
            g = dy * w[None, :]
            c = tl.sum(g * x_hat, axis=1) / n_cols
            dx = (g - x_hat * c[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], cast_rtne(dx, DX.dtype.element_ty, EMULATE_RTNE), mask=mask)
        tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_mask)
    else:
        # Phase A: c = mean(g * x_hat) of every row of the chunk, into the fp32 scratch C.
        for row0 in range(row_start, row_end, BLOCK_M):
            rows = row0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < n_cols
                mask = row_mask[:, None] & col_mask[None, :]
                dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
                acc += dy * w[None, :] * x * rstd[:, None]
            tl.store(C + rows, tl.sum(acc, axis=1) / n_cols, mask=row_mask)
        # C was written by other threads of this program: make it visible before reading.
        tl.debug_barrier()
        # Phase B: column tile outer, rows inner, so the dw partial of a tile stays in registers.
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < n_cols
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
            dw_acc = acc_zeros(BLOCK_N, ACC_F64)
            for row0 in range(row_start, row_end, BLOCK_M):
                rows = row0 + tl.arange(0, BLOCK_M)
                row_mask = rows < row_end
                rows64 = rows.to(tl.int64)
                mask = row_mask[:, None] & col_mask[None, :]
                dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
                c = tl.load(C + rows, mask=row_mask, other=0.0)
                x_hat = x * rstd[:, None]
                dx = (dy * w[None, :] - x_hat * c[:, None]) * rstd[:, None]
                if HAS_DS:
                    dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], cast_rtne(dx, DX.dtype.element_ty, EMULATE_RTNE), mask=mask)
                dw_acc += tl.sum((dy * x_hat).to(dw_acc.dtype), axis=0)
            tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit
def _partials_sum_kernel(
    PART, OUT, PART2, OUT2,
    n_parts, n_cols,
    HAS_SECOND: tl.constexpr,  # a second [n_parts, n_cols] buffer (LayerNorm's dbias) in the same launch
    EMULATE_RTNE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Second stage of the weight-grad reductions: OUT[c] = sum over p of PART[p, c] for BLOCK_N
    columns per program (and OUT2 from PART2), shared by rms_norm and layer_norm.

    Summed in fp64 whatever the partials' dtype (fp64 for fp32 inputs, fp32 for half inputs),
    in a fixed order (a [BLOCK_P, BLOCK_N] running sum over the partial
    rows, then one tree over BLOCK_P), so bitwise deterministic; rounded once to fp32, then to
    OUT's dtype (fp64 -> fp32 -> bf16, the double rounding torch's `.to` does from fp64 too).
    """
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float64)
    acc2 = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float64)
    for p0 in range(0, n_parts, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_mask[None, :]
        offs = parts.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc += tl.load(PART + offs, mask=mask, other=0.0).to(tl.float64)
        if HAS_SECOND:
            acc2 += tl.load(PART2 + offs, mask=mask, other=0.0).to(tl.float64)
    s = tl.sum(acc, axis=0).to(tl.float32)
    tl.store(OUT + cols, cast_rtne(s, OUT.dtype.element_ty, EMULATE_RTNE), mask=col_mask)
    if HAS_SECOND:
        s2 = tl.sum(acc2, axis=0).to(tl.float32)
        tl.store(OUT2 + cols, cast_rtne(s2, OUT2.dtype.element_ty, EMULATE_RTNE), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch configuration: the one place where block sizes, warps and grids are chosen
# --------------------------------------------------------------------------------------------

# Widest row held whole in registers: 16384 fp32 over 16 warps is 32 registers per thread per
# live row tensor (the backward keeps ~5: x, dy, x_hat, g, the dw accumulator), within the
# 255-register limit. Llama-3-405B's hidden size is 16384, so every LLM hidden size we know
# of takes the one-read path. Wider rows loop over LOOP_BLOCK_N-column tiles.
MAX_FUSED_N = 16384
LOOP_BLOCK_N = 4096
# Elements per block: forward ~4096 (one 4096-wide row, 16 elements = two 16-byte bf16 vectors
# per thread at 8 warps); backward 8192 (2 rows of 4096) at no more than 8 warps. Best of the H200
# sweeps at 16384 x 4096 bf16 (benchmarks/cases/norms.py): forward 66.3 us, fwd+bwd 181.5 us;
# 16 warps in the backward 212.3 us. LayerNorm picks its own (layer_norm.py).
FWD_BLOCK_ELEMS = 4096
BWD_BLOCK_ELEMS = 8192
BWD_MAX_WARPS = 8
MAX_BLOCK_M = 64
# Persistent backward grid: programs per SM (4 per SM measured 192.9 us against 181.5).
BWD_PROGRAMS_PER_SM = 2

# Second stage of the weight-grad reductions in one Triton launch instead of torch's `sum(0)`
# plus casts (2-3 small kernels per buffer): LayerNorm fwd+bwd 229.0 -> 197.5 us, RMSNorm
# 191.8 -> 175.1 us on the H200. Its tile: all partial rows of a column block at once (BLOCK_P =
# next power of 2 of n_programs, at most PARTIALS_MAX_BLOCK_P; more rows loop) over
# PARTIALS_BLOCK_ELEMS / BLOCK_P columns: 264 programs -> [512, 8] tiles, each one load per
# buffer deep (the stage is latency-bound: 4.3-8.7 MB per buffer spread over the whole GPU).
PARTIALS_BLOCK_ELEMS = 4096
PARTIALS_MAX_BLOCK_P = 512
PARTIALS_NUM_WARPS = 4


def dw_acc_f64(dtype: torch.dtype) -> bool:
    """Whether weight-grad partials are accumulated (and stored) in fp64: fp32 inputs only."""
    return dtype not in (torch.float16, torch.bfloat16)


def partials_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the [n_programs, N] weight-grad partials for inputs of `dtype`."""
    return torch.float64 if dw_acc_f64(dtype) else torch.float32


@lru_cache(maxsize=1024)
def _partials_plan(n_parts: int, n_cols: int) -> tuple[tuple[int], int, int]:
    """(grid, BLOCK_P, BLOCK_N) of `_partials_sum_kernel`, cached on the ints (the norms' eager
    backward is host-bound; benchmarks/host_cost_cpu.py)."""
    block_p = min(next_power_of_2(n_parts), PARTIALS_MAX_BLOCK_P)
    block_n = min(next_power_of_2(n_cols), max(1, PARTIALS_BLOCK_ELEMS // block_p))
    return (cdiv(n_cols, block_n),), block_p, block_n


def sum_partials(*parts: tuple[torch.Tensor, torch.dtype]) -> list[torch.Tensor]:
    """Second stage of the weight-grad reductions: each (partials [n_programs, N], dtype) ->
    the column sums (N,) in `dtype`, summed in fp64 in a fixed order (bitwise deterministic) and
    rounded once to fp32 before `dtype`. One or two buffers of the same shape, one launch."""
    (p1, dt1), (p2, dt2) = parts[0], parts[-1]
    assert len(parts) <= 2 and p1.shape == p2.shape
    n_parts, n_cols = p1.shape
    out1 = torch.empty(n_cols, dtype=dt1, device=p1.device)
    out2 = torch.empty(n_cols, dtype=dt2, device=p1.device) if len(parts) == 2 else out1
    grid, block_p, block_n = _partials_plan(n_parts, n_cols)
    launch(_partials_sum_kernel, grid,
        p1, out1, p2, out2, n_parts, n_cols,
        HAS_SECOND=len(parts) == 2, EMULATE_RTNE=INTERPRETED,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=PARTIALS_NUM_WARPS,
        **FP_FUSION,
    )
    return [out1, out2] if len(parts) == 2 else [out1]


@dataclass(frozen=True)
class RowConfig:
    """Launch parameters of the norms' row-wise kernels (shared by rms_norm and layer_norm),
    from the shared helpers `common.row_tile` and `common.num_warps`."""

    block_m: int  # rows per block
    block_n: int  # columns per block: the whole row (a power of 2) unless `loop`
    num_warps: int
    loop: bool  # row wider than MAX_FUSED_N: loop over column tiles

    @staticmethod
    def _for(n_cols: int, block_elems: int, max_warps: int = 16) -> "RowConfig":
        if n_cols > MAX_FUSED_N:
            return RowConfig(1, LOOP_BLOCK_N, num_warps(LOOP_BLOCK_N, max_warps=max_warps), True)
        block_m, block_n = row_tile(n_cols, block_elems, MAX_BLOCK_M)
        return RowConfig(block_m, block_n, num_warps(block_m * block_n, max_warps=max_warps), False)

    @staticmethod
    @lru_cache(maxsize=256)
    def forward(n_cols: int) -> "RowConfig":
        return RowConfig._for(n_cols, FWD_BLOCK_ELEMS)

    @staticmethod
    @lru_cache(maxsize=256)
    def backward(n_cols: int, block_elems: int | None = None, max_warps: int | None = None) -> "RowConfig":
        """The persistent backward's blocks: `block_elems` elements (default BWD_BLOCK_ELEMS,
        RMSNorm's), at most `max_warps` warps (default BWD_MAX_WARPS; more registers per thread
        than the forward)."""
        return RowConfig._for(n_cols, block_elems or BWD_BLOCK_ELEMS, max_warps or BWD_MAX_WARPS)


def backward_grid(n_rows: int, cfg: RowConfig, device: torch.device) -> tuple[int, int]:
    """(n_programs, rows_per_program) of the persistent backward; rows_per_program is a
    multiple of block_m so blocks never straddle two programs."""
    n_blocks = cdiv(n_rows, cfg.block_m)
    n_programs = persistent_programs(n_blocks, device, BWD_PROGRAMS_PER_SM)
    return n_programs, cdiv(n_blocks, n_programs) * cfg.block_m


class BackwardPlan(NamedTuple):
    """Everything the norms' backward launch derives from its shape, dtype and device."""

    cfg: RowConfig
    n_programs: int
    rows_per_program: int
    part_dtype: torch.dtype  # of the [n_programs, N] weight-grad partials
    acc_f64: bool


@lru_cache(maxsize=1024)
def backward_plan(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device, sms: int,
                  block_elems: int | None = None, max_warps: int | None = None) -> BackwardPlan:
    """The persistent backward's plan, cached: built per call it was ~4 us of the rms_norm
    backward's Python (benchmarks/host_cost_cpu.py). `sms` is `sm_count(device)`, in the key so
    that a changed count (tests patch it to the H200's) gets its own grid."""
    cfg = RowConfig.backward(n_cols, block_elems, max_warps)
    n_programs, rows_per_program = backward_grid(n_rows, cfg, device)
    return BackwardPlan(cfg, n_programs, rows_per_program, partials_dtype(dtype), dw_acc_f64(dtype))


# --------------------------------------------------------------------------------------------
# Checks and host launchers
# --------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: torch.Tensor, casting: str, residual: Optional[torch.Tensor] = None) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise KprofError("rms_norm: x and weight must be tensors")
    if x.dim() == 0:
        raise KprofError("rms_norm: x must have at least one dimension (the normalized last dim); got a scalar")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise KprofError(
            f"rms_norm: supports float32/float16/bfloat16, got x {x.dtype} and weight {weight.dtype}; "
            "cast the inputs first"
        )
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KprofError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dim; got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise KprofError(f"rms_norm: x is on {x.device} but weight is on {weight.device}; move them together")
    if casting not in _CASTINGS:
        raise KprofError(f"rms_norm: casting must be one of {_CASTINGS}, got {casting!r}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise KprofError(
                "rms_norm_add: residual must match x in shape, dtype and device; got x "
                f"{tuple(x.shape)} {x.dtype} {x.device}, residual {tuple(residual.shape)} {residual.dtype} "
                f"{residual.device}"
            )


@lru_cache(maxsize=None)  # torch.promote_types is an aten op through the dispatcher: ~1 us a call
def _out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, casting: str) -> torch.dtype:
    # llama: `weight * h.to(x.dtype)` promotes; gemma: `.type_as(x)`.
    return torch.promote_types(x_dtype, w_dtype) if casting == "llama" else x_dtype


# The launchers are the eager hot path (the autograd.Functions call them directly after the
# public function's checks; the custom ops check `require_triton` first): contiguous tensors go
# to the kernels as they are, with row stride N (no .view: ~1-3 us each), outputs come from
# `new_out`, and the launch plans are cached per shape.


def _launch_fwd(x, residual, weight, eps, offset, casting):
    n_cols = x.shape[-1]
    y = new_out(x, _out_dtype(x.dtype, weight.dtype, casting))
    s = new_out(x) if residual is not None else None
    n_rows = x.numel() // n_cols if n_cols else numel(x.shape[:-1])
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)  # flat (see new_out); the ops view it
    if n_rows == 0 or n_cols == 0:
        return y, s, rstd.fill_(math.nan)  # mean of an empty row is undefined, as in torch
    x2, sx = rows_and_stride(x, n_cols)
    r2, sr = rows_and_stride(residual, n_cols) if residual is not None else (x2, sx)
    cfg = RowConfig.forward(n_cols)
    launch(_rms_norm_fwd_kernel, (cdiv(n_rows, cfg.block_m),),
        x2, r2, weight.contiguous(), y, s if s is not None else y, rstd,
        sx, sr, n_cols, n_cols,
        n_rows, n_cols, eps, offset,
        HAS_RESIDUAL=residual is not None, GEMMA=casting == "gemma", LOOP=cfg.loop,
        EMULATE_RTNE=INTERPRETED,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        **FP_FUSION,
    )
    return y, s, rstd


def _launch_bwd(dy, x, weight, rstd, ds, offset):
    n_cols = x.shape[-1]
    dx = new_out(x)
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    rstd = rstd if rstd.is_contiguous() else rstd.contiguous()  # read as one flat row per x row
    dy2, sdy = rows_and_stride(dy, n_cols)
    x2, sx = rows_and_stride(x, n_cols)
    ds2, sds = rows_and_stride(ds, n_cols) if ds is not None else (dy2, sdy)
    plan = backward_plan(n_rows, n_cols, x.dtype, x.device, sm_count(x.device))
    cfg = plan.cfg
    dw_part = torch.empty(plan.n_programs, n_cols, dtype=plan.part_dtype, device=x.device)
    # Per-row scratch for the looped path only (c = mean(g * x_hat)); otherwise the kernel never
    # touches C and rstd (fp32 too) stands in: one torch.empty less (~2 us of host time here).
    c = torch.empty(n_rows, dtype=torch.float32, device=x.device) if cfg.loop else rstd
    launch(_rms_norm_bwd_kernel, (plan.n_programs,),
        dy2, x2, weight.contiguous(), rstd, ds2, dx, dw_part, c,
        sdy, sx, sds, n_cols,
        n_rows, n_cols, offset, plan.rows_per_program,
        HAS_DS=ds is not None, LOOP=cfg.loop,
        EMULATE_RTNE=INTERPRETED, ACC_F64=plan.acc_f64,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        **FP_FUSION,
    )
    # Second stage of the dw reduction: n_programs x N summed in fp64 in a fixed order, so
    # deterministic; rounded once (via fp32) to the weight's dtype.
    (dw,) = sum_partials((dw_part, weight.dtype))
    return dx, dw


# --------------------------------------------------------------------------------------------
# torch.library custom ops (so torch.compile sees one opaque op, no graph break)
# --------------------------------------------------------------------------------------------


@kernel_op("kprof::rms_norm_fwd")
def _rms_norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x, "rms_norm")
    y, _, rstd = _launch_fwd(x, None, weight, eps, offset, casting)
    return y, rstd.view(x.shape[:-1])


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, offset, casting):
    y = x.new_empty(x.shape, dtype=_out_dtype(x.dtype, weight.dtype, casting))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@kernel_op("kprof::rms_norm_add_fwd")
def _rms_norm_add_fwd_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require_triton(x, "rms_norm")
    y, s, rstd = _launch_fwd(x, residual, weight, eps, offset, casting)
    return y, s, rstd.view(x.shape[:-1])


@_rms_norm_add_fwd_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    y = x.new_empty(x.shape, dtype=_out_dtype(x.dtype, weight.dtype, casting))
    return y, x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@kernel_op("kprof::rms_norm_bwd")
def _rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, ds: Optional[torch.Tensor], offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x, "rms_norm backward")
    return _launch_bwd(dy, x, weight, rstd, ds, offset)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, ds, offset):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):
        if via_custom_op():
            y, rstd = torch.ops.kprof.rms_norm_fwd(x, weight, eps, offset, casting)
        else:  # eager: skip the custom-op dispatch (host cost, see common.via_custom_op)
            y, _, rstd = _launch_fwd(x, None, weight, eps, offset, casting)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        bwd = torch.ops.kprof.rms_norm_bwd if via_custom_op() else _launch_bwd
        dx, dw = bwd(dy, x, weight, rstd, None, ctx.offset)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None,
            None, None, None,
        )


class _RMSNormAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting):
        fwd = torch.ops.kprof.rms_norm_add_fwd if via_custom_op() else _launch_fwd
        y, s, rstd = fwd(x, residual, weight, eps, offset, casting)
        ctx.save_for_backward(s, weight, rstd)
        ctx.offset = offset
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        # d(x + residual) / dx = d(x + residual) / dresidual = 1: one gradient serves both.
        bwd = torch.ops.kprof.rms_norm_bwd if via_custom_op() else _launch_bwd
        dx, dw = bwd(dy, s, weight, rstd, ds, ctx.offset)
        return (
            dx if ctx.needs_input_grad[0] else None,
            dx if ctx.needs_input_grad[1] else None,
            dw if ctx.needs_input_grad[2] else None,
            None, None, None,
        )


# --------------------------------------------------------------------------------------------
# Public functions and module
# --------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (..., N) with a weight of shape (N,).

    casting="llama" matches transformers' LlamaRMSNorm exactly: x̂ = x * rsqrt(mean(x²) + eps)
    computed in fp32, cast to x's dtype, then multiplied by (weight + offset); the result's
    dtype is promote(x.dtype, weight.dtype) (fp32 if HF keeps an fp32 weight under bf16).
    casting="gemma" (use offset=1.0) matches GemmaRMSNorm: everything in fp32,
    (x̂ * (offset + weight)) cast once to x's dtype.
    dtypes: float32, float16, bfloat16 for x and weight, in any combination. Differentiable in
    x and weight; any leading shape and strides; rows of any width (see RowConfig).
    """
    _check(x, weight, casting)
    if use_triton(x):
        return _RMSNormFunction.apply(x, weight, float(eps), float(offset), casting)
    warn_fallback("rms_norm", f"no Triton for tensors on {x.device}")
    return rms_norm_reference(x, weight, eps, offset=offset, casting=casting)


def rms_norm_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns (rms_norm(x + residual), x + residual).

    The sum is computed in fp32 and rounded to x's dtype (as HF's `residual + hidden_states`
    in the activation dtype), and the rounded sum is what gets normalized and returned.
    x and residual must share shape and dtype. Other arguments as `rms_norm`.
    """
    _check(x, weight, casting, residual)
    if use_triton(x):
        return _RMSNormAddFunction.apply(x, residual, weight, float(eps), float(offset), casting)
    warn_fallback("rms_norm_add", f"no Triton for tensors on {x.device}")
    return rms_norm_add_reference(x, residual, weight, eps, offset=offset, casting=casting)


class RMSNorm(nn.Module):
    """Drop-in for transformers' LlamaRMSNorm (casting="llama", offset=0) and GemmaRMSNorm
    (casting="gemma", offset=1.0): a `weight` Parameter of shape (hidden_size,), so state
    dicts load unchanged. The weight starts at 1 - offset (ones for Llama, zeros for Gemma),
    so a fresh module is the identity scale in both modes."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "llama",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if casting not in _CASTINGS:
            raise KprofError(f"RMSNorm: casting must be one of {_CASTINGS}, got {casting!r}")
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset
        self.casting = casting

    # HF's Llama-family modules call it variance_epsilon; keep code that reads it working.
    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, casting={self.casting!r}"


# --------------------------------------------------------------------------------------------
# PyTorch references (used by the CPU fallback, by `kprof apply` to verify, and by the tests)
# --------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> torch.Tensor:
    """HF's LlamaRMSNorm / GemmaRMSNorm in plain PyTorch. Computes in fp32, or in fp64 for
    fp64 inputs (so tests can use it as a higher-precision oracle)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (h * (offset + weight.to(acc))).to(x.dtype)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if offset == 0.0:
        return weight * h.to(x.dtype)  # literally HF's LlamaRMSNorm
    return ((offset + weight.to(acc)) * h.to(x.dtype).to(acc)).to(out_dtype)


def rms_norm_add_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual` in x's dtype, then `rms_norm_reference(s, ...)`; returns (y, s)."""
    s = x + residual
    return rms_norm_reference(s, weight, eps, offset=offset, casting=casting), s


# --------------------------------------------------------------------------------------------
# Cost model and registry
# --------------------------------------------------------------------------------------------

# FLOPs per element, counted from the kernels above:
#   forward:  x*x, +sum, *rstd, *w                                                    = 4
#   backward: x_hat = x*rstd, g = dy*w, g*x_hat and +sum, dx = (g - x_hat*c)*rstd (3),
#             dw += dy*x_hat (2)                                                       = 9
#   the residual add (forward) and the + ds (backward) of the fused variant: 1 each.
_FWD_FLOPS, _BWD_FLOPS = 4, 9


def rms_norm_cost(
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype,
    weight_dtype: Optional[torch.dtype] = None,
    casting: str = "llama",
    residual: bool = False,
) -> dict[str, Cost]:
    """Minimal bytes (each input read once, each output written once) and FLOPs."""
    wdt = weight_dtype or dtype
    elems = n_rows * n_cols
    xs, ws, ys = dtype.itemsize, wdt.itemsize, _out_dtype(dtype, wdt, casting).itemsize
    rstd = n_rows * 4
    fwd_bytes = elems * xs + n_cols * ws + elems * ys + rstd  # x, w -> y, rstd
    bwd_bytes = elems * ys + elems * xs + n_cols * ws + rstd + elems * xs + n_cols * ws  # dy, x, w, rstd -> dx, dw
    fwd_flops, bwd_flops = _FWD_FLOPS * elems, _BWD_FLOPS * elems
    if residual:
        fwd_bytes += 2 * elems * xs  # read residual, write the sum
        bwd_bytes += elems * xs  # read d(sum); d(residual) is the same tensor as dx
        fwd_flops += elems
        bwd_flops += elems
    return {"fwd": Cost(fwd_flops, fwd_bytes), "bwd": Cost(bwd_flops, bwd_bytes)}


def rms_norm_add_cost(
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype,
    weight_dtype: Optional[torch.dtype] = None,
    casting: str = "llama",
) -> dict[str, Cost]:
    return rms_norm_cost(n_rows, n_cols, dtype, weight_dtype, casting, residual=True)


def _fwd_op_cost(metas: list[TensorMeta]) -> Cost:
    # (x, weight). The casting is not a tensor argument, so the output dtype is assumed to be
    # llama's promote(x, weight); it differs from gemma's only when x and weight dtypes differ.
    x, w = metas[0], metas[1]
    return rms_norm_cost(*rows_cols(x.shape), x.dtype, w.dtype)["fwd"]


def _add_fwd_op_cost(metas: list[TensorMeta]) -> Cost:
    x, w = metas[0], metas[2]  # (x, residual, weight)
    return rms_norm_cost(*rows_cols(x.shape), x.dtype, w.dtype, residual=True)["fwd"]


def _bwd_op_cost(metas: list[TensorMeta]) -> Cost:
    # (dy, x, weight, rstd[, ds]); a None ds may be absent or recorded with another shape.
    dy, x, w = metas[0], metas[1], metas[2]
    n_rows, n_cols = rows_cols(x.shape)
    has_ds = any(m is not None and tuple(m.shape) == tuple(x.shape) for m in metas[4:5])
    elems = n_rows * n_cols
    nbytes = elems * (dy.dtype.itemsize + 2 * x.dtype.itemsize) + 2 * n_cols * w.dtype.itemsize + n_rows * 4
    flops = _BWD_FLOPS * elems
    if has_ds:
        nbytes += elems * x.dtype.itemsize
        flops += elems
    return Cost(flops, nbytes)


_LIMITS = (
    f"last dim of any width: rows up to {MAX_FUSED_N} are held in registers (x read once); wider rows "
    f"loop over {LOOP_BLOCK_N}-column tiles (x read twice per pass, the second mostly from L2)"
)

SPEC = register(
    KernelSpec(
        name="rms_norm",
        replaces="HF LlamaRMSNorm / GemmaRMSNorm: pow, mean, add, rsqrt, mul, cast, mul (~7 kernels fwd, ~10 bwd)",
        dtypes=_DTYPES,
        limits=_LIMITS,
        deterministic=True,  # no atomics; dw partials reduced in a fixed order
        fn=rms_norm,
        module=RMSNorm,
        reference=rms_norm_reference,
        cost=rms_norm_cost,
        op_costs={"kprof::rms_norm_fwd": _fwd_op_cost, "kprof::rms_norm_bwd": _bwd_op_cost},
    )
)

ADD_SPEC = register(
    KernelSpec(
        name="rms_norm_add",
        replaces="residual add followed by RMSNorm (HF decoder layer: `h = residual + h; h = norm(h)`)",
        dtypes=_DTYPES,
        limits=_LIMITS + "; x and residual must share shape and dtype",
        deterministic=True,
        fn=rms_norm_add,
        module=None,
        reference=rms_norm_add_reference,
        cost=rms_norm_add_cost,
        op_costs={"kprof::rms_norm_add_fwd": _add_fwd_op_cost},
    )
)

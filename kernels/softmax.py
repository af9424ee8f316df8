"""Fused scaled, masked softmax over the last dim: the hand-written attention pattern in one pass.

Eager code users write today (nanoGPT, hand-rolled attention):

    scores = q @ k.transpose(-2, -1) * scale          # [B, H, L, S]
    scores = scores.masked_fill(mask == 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1)

is three elementwise passes (scale, masked_fill, softmax), each reading and writing the
[B, H, L, S] scores. `softmax(x, scale=..., mask=..., causal=...)` does it in one read and one
write; the backward reads y and dy once and writes dx once.

Why: x = [16384, 8192] bf16 (268 MB) must move 537 MB forward (read x, write y: 126 us at the
H200's 4.27 TB/s copy bandwidth) and 805 MB backward (read y, dy, write dx: 189 us); the
in-register kernels measure 130 us fwd / 186 us bwd on the H200, at that floor. A boolean mask adds mask.numel() bytes (read once, before broadcasting). `causal` takes bytes
away: query i reads keys 0..i only (rounded up to 16 columns), about half of x in the forward
and of y, dy in the backward for square scores (L = S = 1024: fwd 0.5 + 1 = 1.5x |x| instead
of 2x, bwd 2x instead of 3x). The registry's cost (`_cost`) does not model that saving: for
causal calls it is an upper bound.

Regimes (chosen by `SoftmaxConfig.for_cols`, the one place launch parameters are picked):
- n_cols <= 32768 (`MAX_FUSED_COLS`): the whole row sits in registers (at 32 warps, <= 32 fp32
  values per thread); several short rows share one program so each program moves ~4K elements.
- n_cols > 32768: one row per program, looping over the row in 4096-wide blocks: pass 1 keeps
  a per-lane running max and sum (online softmax), pass 2 re-reads x and writes y. That is one
  extra read of x (1.5x the bytes), traded for never spilling registers.
The backward has the same two regimes (pass 1: sum(y * dy); pass 2: dx).

Host work per eager call (the H200 machine's eager path is host-bound, see
kernels/common.py::via_custom_op): one output allocation and one launch per direction for a
contiguous x; the mask is passed as the bool tensor it is, its broadcast strides computed in
Python (tests/kernels/test_softmax.py::test_eager_path_launches_directly).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels.common import (
    FP_FUSION,
    cdiv,
    kernel_op,
    launch,
    new_out,
    num_warps,
    row_tile,
    rows_and_stride,
    rows_cols,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# 1. Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _keep(
    rows, cols, inb, mask_ptr, m_size1, m_size2, m_stride0, m_stride1, m_stride2, m_stride_col,
    q_len, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Which in-bounds elements are kept (not masked). rows: [R, 1] row indices, cols: [1, C].

    rows is int32 unless there are >= 2^31 rows: the div/mod below are then 32-bit. As int64
    they were 5 calls to ptxas's 64-bit division routine per thread in the masked causal
    forward (sm_90 SASS: 776 instructions vs 376 unmasked for a [4, 1024] tile of 16 elements
    per thread; on the H200 that kernel took 220 us against 130 us unmasked for equal bytes).
    """
    keep = inb
    if HAS_MASK:
        # The mask is addressed through its broadcast strides (stride 0 on broadcast dims), with
        # x's leading dims collapsed to at most three (see `_mask_layout`): row -> (i0, i1, i2).
        i2 = rows % m_size2
        t = rows // m_size2
        i1 = t % m_size1
        i0 = t // m_size1
        m_off = (i0.to(tl.int64) * m_stride0 + i1.to(tl.int64) * m_stride1 + i2.to(tl.int64) * m_stride2
                 + cols * m_stride_col)
        m = tl.load(mask_ptr + m_off, mask=inb, other=0)
        keep = keep & (m != 0)
    if CAUSAL:
        # Top-left aligned like torch.tril(ones(L, S)) and SDPA's is_causal: query i keeps keys j <= i.
        keep = keep & (cols <= rows % q_len)
    return keep


@triton.jit
def _to_read(rows, cols, inb, q_len, CAUSAL: tl.constexpr):
    """Which elements to read from memory. With CAUSAL, query i needs keys j <= i only: reads stop
    at i + 1 rounded up to 16 columns (whole 16-element groups keep the loads 16-byte vectors),
    which skips ~half of x (forward) and of y, dy (backward) for square causal scores."""
    if CAUSAL:
        return inb & (cols < ((rows % q_len) // 16 + 1) * 16)
    return inb


@triton.jit
def _softmax_fwd_rows_kernel(
    x_ptr, y_ptr, mask_ptr, n_rows, n_cols, x_row_stride, y_row_stride, scale,
    m_size1, m_size2, m_stride0, m_stride1, m_stride2, m_stride_col, q_len,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
    IDX64: tl.constexpr,
):
    """ROWS whole rows per program, each held in registers: one read of x, one write of y."""
    # [ROWS, 1] row indices for index math: int32 (32-bit div/mod in `_keep`) below 2^31 rows.
    if IDX64:
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    else:
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    rows = r.to(tl.int64)  # for addresses
    cols = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    inb = (r < n_rows) & (cols < n_cols)
    rd = _to_read(r, cols, inb, q_len, CAUSAL)
    keep = _keep(r, cols, rd, mask_ptr, m_size1, m_size2, m_stride0, m_stride1, m_stride2,
                 m_stride_col, q_len, HAS_MASK, CAUSAL)
    x = tl.load(x_ptr + rows * x_row_stride + cols, mask=rd, other=0.0).to(tl.float32)
    z = tl.where(keep, x * scale, float("-inf"))
    m = tl.max(z, axis=1)
    # A fully masked row has max -inf; shifting by 0 instead makes every exp 0, the sum 0 and the
    # output 0 (eager gives NaN there).
    m = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(z - m[:, None])
    s = tl.sum(p, axis=1)
    inv = 1.0 / tl.where(s > 0.0, s, 1.0)
    y = p * inv[:, None]
    tl.store(y_ptr + rows * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _softmax_fwd_looped_kernel(
    x_ptr, y_ptr, mask_ptr, n_rows, n_cols, x_row_stride, y_row_stride, scale,
    m_size1, m_size2, m_stride0, m_stride1, m_stride2, m_stride_col, q_len,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One long row per program: pass 1 online max/sum per lane, pass 2 writes y."""
    pid = tl.program_id(0)
    r = tl.zeros((1, 1), dtype=tl.int32) + pid  # [1, 1] row index (grid size < 2^31), for index math
    rows = r.to(tl.int64)  # for addresses
    lanes = tl.arange(0, BLOCK_N)[None, :]
    x_row = x_ptr + rows * x_row_stride
    m_vec = tl.full((1, BLOCK_N), float("-inf"), tl.float32)
    s_vec = tl.zeros((1, BLOCK_N), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lanes
        inb = cols < n_cols
        rd = _to_read(r, cols, inb, q_len, CAUSAL)
        keep = _keep(r, cols, rd, mask_ptr, m_size1, m_size2, m_stride0, m_stride1, m_stride2,
                     m_stride_col, q_len, HAS_MASK, CAUSAL)
        x = tl.load(x_row + cols, mask=rd, other=0.0).to(tl.float32)
        z = tl.where(keep, x * scale, float("-inf"))
        m_new = tl.maximum(m_vec, z)
        # Lanes that have seen only -inf keep shift 0 so exp(-inf - 0) = 0, never exp(nan).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_vec = s_vec * tl.exp(m_vec - shift) + tl.exp(z - shift)
        m_vec = m_new
    m = tl.max(m_vec, axis=1)  # [1]
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_vec * tl.exp(m_vec - m[:, None]), axis=1)
    inv = 1.0 / tl.where(s > 0.0, s, 1.0)
    y_row = y_ptr + rows * y_row_stride
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lanes
        inb = cols < n_cols
        rd = _to_read(r, cols, inb, q_len, CAUSAL)
        keep = _keep(r, cols, rd, mask_ptr, m_size1, m_size2, m_stride0, m_stride1, m_stride2,
                     m_stride_col, q_len, HAS_MASK, CAUSAL)
        x = tl.load(x_row + cols, mask=rd, other=0.0).to(tl.float32)
        z = tl.where(keep, x * scale, float("-inf"))
        y = tl.exp(z - m[:, None]) * inv[:, None]
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _softmax_bwd_rows_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, y_row_stride, dy_row_stride, dx_row_stride, scale, q_len,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, IDX64: tl.constexpr,
):
    """dx = scale * y * (dy - sum(dy * y)); masked positions have y = 0, so dx = 0 there (with
    CAUSAL, y and dy past the diagonal are not even read: y is 0 there)."""
    # [ROWS, 1] row indices for index math: int32 (32-bit div/mod in `_keep`) below 2^31 rows.
    if IDX64:
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    else:
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    rows = r.to(tl.int64)  # for addresses
    cols = tl.arange(0, BLOCK_N)[None, :]
    inb = (r < n_rows) & (cols < n_cols)
    rd = _to_read(r, cols, inb, q_len, CAUSAL)
    y = tl.load(y_ptr + rows * y_row_stride + cols, mask=rd, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=rd, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    dx = y * (dy - dot[:, None]) * scale
    tl.store(dx_ptr + rows * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _softmax_bwd_looped_kernel(
    y_ptr, dy_ptr, dx_ptr, n_rows, n_cols, y_row_stride, dy_row_stride, dx_row_stride, scale, q_len,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    r = tl.program_id(0)  # row index (grid size < 2^31), for index math
    pid = r.to(tl.int64)  # for addresses
    lanes = tl.arange(0, BLOCK_N)
    y_row = y_ptr + pid * y_row_stride
    dy_row = dy_ptr + pid * dy_row_stride
    dx_row = dx_ptr + pid * dx_row_stride
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lanes
        inb = cols < n_cols
        rd = _to_read(r, cols, inb, q_len, CAUSAL)
        y = tl.load(y_row + cols, mask=rd, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=rd, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + lanes
        inb = cols < n_cols
        rd = _to_read(r, cols, inb, q_len, CAUSAL)
        y = tl.load(y_row + cols, mask=rd, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=rd, other=0.0).to(tl.float32)
        dx = y * (dy - dot) * scale
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=inb)


# ---------------------------------------------------------------------------------------------
# 2. Host launchers
# ---------------------------------------------------------------------------------------------

# Rows up to this many elements stay in registers: 32768 fp32 values over 32 warps (1024
# threads) is 32 registers per thread in the forward, 64 in the backward (y and dy), still
# spill-free. Longer rows take the looped path.
MAX_FUSED_COLS = 32768
# Elements one program handles in the in-register path; short rows are packed up to this.
TILE_ELEMS = 4096
# Block width of the looped path: 4096 fp32 over 8 warps = 16 values per thread per array.
LOOP_BLOCK = 4096


@dataclass(frozen=True)
class SoftmaxConfig:
    """Launch parameters, from the register budget above (at the copy floor on the H200)."""

    block_n: int
    rows: int  # rows per program (in-register path); 1 when looped
    num_warps: int
    looped: bool

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def for_cols(n_cols: int) -> "SoftmaxConfig":
        # Cached: built once per width, not per call (the eager path is host-bound on the H200).
        if n_cols > MAX_FUSED_COLS:
            return SoftmaxConfig(block_n=LOOP_BLOCK, rows=1, num_warps=8, looped=True)
        rows, block_n = row_tile(n_cols, TILE_ELEMS)
        # ~16 elements (two 16-byte bf16 vectors) per thread at 4K-8K tiles; 32 warps is the max.
        warps = num_warps(block_n * rows, max_warps=32)
        return SoftmaxConfig(block_n=block_n, rows=rows, num_warps=warps, looped=False)


def _mask_layout(mask: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Describe `mask` broadcast to `shape` for the kernel, from its shape and strides alone.

    Returns (mask, (size1, size2, stride0, stride1, stride2, stride_col)): x's leading dims
    collapsed to at most three (i0, i1, i2) with the mask's broadcast strides (0 on broadcast
    dims). Leading dims merge when the mask is contiguous across them or both are broadcast; a
    mask that still needs more than three is materialized (one copy; only exotic layouts need it).
    The bool tensor itself is passed (Triton loads `*i1` as bytes), so no view or expand runs.
    """
    pad = len(shape) - mask.dim()
    m_shape, m_stride = mask.shape, mask.stride()
    # Broadcast strides of mask.expand(shape), computed without calling expand.
    strides = [0] * pad + [m_stride[i] if m_shape[i] != 1 else 0 for i in range(mask.dim())]
    merged: list[tuple[int, int]] = []
    for size, stride in zip(shape[:-1], strides[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 3:
        mask = mask.expand(shape).contiguous()
        merged = [(mask.numel() // shape[-1], shape[-1])]
        strides[-1] = 1
    merged = [(1, 0)] * (3 - len(merged)) + merged
    (_, s0), (z1, s1), (z2, s2) = merged
    return mask, (z1, z2, s0, s1, s2, strides[-1])


_NO_MASK = (1, 1, 0, 0, 0, 0)


def _softmax_fwd(
    x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool, config: Optional[SoftmaxConfig] = None
) -> torch.Tensor:
    """`config` overrides the launch parameters (benchmarks/cases/softmax_rope.py sweeps them)."""
    # Host work per call is one torch.empty and one launch for contiguous x (each aten op is
    # ~12 us and a launch ~24 us of host time on the H200 machine, where this path is host-bound).
    shape = x.shape
    y = new_out(x)
    n_cols = shape[-1]
    n = x.numel()
    if n == 0:
        return y
    n_rows = n // n_cols
    x2, x_rs = rows_and_stride(x, n_cols)
    if mask is not None:
        mask_t, (z1, z2, s0, s1, s2, sc) = _mask_layout(mask, shape)
    else:
        mask_t, (z1, z2, s0, s1, s2, sc) = x2, _NO_MASK  # unused pointer
    q_len = shape[-2] if len(shape) >= 2 else 1
    cfg = config or SoftmaxConfig.for_cols(n_cols)
    if cfg.looped:
        launch(_softmax_fwd_looped_kernel, (n_rows,),
            x2, y, mask_t, n_rows, n_cols, x_rs, n_cols, scale, z1, z2, s0, s1, s2, sc, q_len,
            BLOCK_N=cfg.block_n, HAS_MASK=mask is not None, CAUSAL=causal, num_warps=cfg.num_warps,
            **FP_FUSION,
        )
    else:
        launch(_softmax_fwd_rows_kernel, (cdiv(n_rows, cfg.rows),),
            x2, y, mask_t, n_rows, n_cols, x_rs, n_cols, scale, z1, z2, s0, s1, s2, sc, q_len,
            ROWS=cfg.rows, BLOCK_N=cfg.block_n, HAS_MASK=mask is not None, CAUSAL=causal,
            IDX64=n_rows + cfg.rows >= 2**31, num_warps=cfg.num_warps,
            **FP_FUSION,
        )
    return y


def _softmax_bwd(
    y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool, config: Optional[SoftmaxConfig] = None
) -> torch.Tensor:
    shape = y.shape
    dx = new_out(y)
    n_cols = shape[-1]
    n = y.numel()
    if n == 0:
        return dx
    n_rows = n // n_cols
    y2, y_rs = rows_and_stride(y, n_cols)
    dy2, dy_rs = rows_and_stride(dy, n_cols)  # a copy only for odd grads (e.g. stride 0 from .sum())
    q_len = shape[-2] if len(shape) >= 2 else 1
    cfg = config or SoftmaxConfig.for_cols(n_cols)
    if cfg.looped:
        launch(_softmax_bwd_looped_kernel, (n_rows,),
            y2, dy2, dx, n_rows, n_cols, y_rs, dy_rs, n_cols, scale, q_len,
            BLOCK_N=cfg.block_n, CAUSAL=causal, num_warps=cfg.num_warps,
            **FP_FUSION,
        )
    else:
        launch(_softmax_bwd_rows_kernel, (cdiv(n_rows, cfg.rows),),
            y2, dy2, dx, n_rows, n_cols, y_rs, dy_rs, n_cols, scale, q_len,
            ROWS=cfg.rows, BLOCK_N=cfg.block_n, CAUSAL=causal, IDX64=n_rows + cfg.rows >= 2**31,
            num_warps=cfg.num_warps,
            **FP_FUSION,
        )
    return dx


# ---------------------------------------------------------------------------------------------
# 3. torch.library custom ops (so torch.compile sees one opaque op, no graph break)
# ---------------------------------------------------------------------------------------------


@kernel_op("kprof::softmax_fwd")
def softmax_fwd_op(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float, causal: bool) -> torch.Tensor:
    return _softmax_fwd(x, mask, scale, causal)


@softmax_fwd_op.register_fake
def _(x, mask, scale, causal):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@kernel_op("kprof::softmax_bwd")
def softmax_bwd_op(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    return _softmax_bwd(y, dy, scale, causal)


@softmax_bwd_op.register_fake
def _(y, dy, scale, causal):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


# ---------------------------------------------------------------------------------------------
# 4. autograd
# ---------------------------------------------------------------------------------------------


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mask, scale, causal):
        # Direct launch in eager mode; the custom op only under compile or a profiler (see via_custom_op).
        y = softmax_fwd_op(x, mask, scale, causal) if via_custom_op() else _softmax_fwd(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale = scale
        ctx.causal = causal
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if via_custom_op():
            dx = softmax_bwd_op(y, dy, ctx.scale, ctx.causal)
        else:
            dx = _softmax_bwd(y, dy, ctx.scale, ctx.causal)
        return dx, None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public function
# ---------------------------------------------------------------------------------------------


def _check(x: torch.Tensor, mask: Optional[torch.Tensor], causal: bool) -> None:
    if x.dtype not in DTYPES:
        raise KprofError(f"softmax: x has dtype {x.dtype}; supported: float32, float16, bfloat16 (cast x first)")
    if x.dim() == 0:
        raise KprofError("softmax: x is a 0-d tensor; it needs a last dim to normalize over")
    if causal and x.dim() < 2:
        raise KprofError(f"softmax: causal=True needs x of at least 2 dims [..., L, S]; got shape {tuple(x.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise KprofError(
                f"softmax: mask has dtype {mask.dtype}; pass a boolean keep-mask (True = keep), "
                "e.g. `mask != 0`; for an additive float mask add it to x first"
            )
        if mask.device != x.device:
            raise KprofError(f"softmax: mask is on {mask.device} but x is on {x.device}; move them to one device")
        # Broadcastable to x without growing it; checked on Python ints (mask.expand would be an op).
        ms, xs = mask.shape, x.shape
        if len(ms) > len(xs) or any(m != 1 and m != s for m, s in zip(reversed(ms), reversed(xs))):
            raise KprofError(
                f"softmax: mask of shape {tuple(ms)} does not broadcast to x of shape {tuple(xs)}"
            )


def softmax(
    x: torch.Tensor, *, scale: float = 1.0, mask: Optional[torch.Tensor] = None, causal: bool = False
) -> torch.Tensor:
    """Softmax over the last dim of `x * scale`, with masked positions excluded.

    Computes `torch.softmax((x * scale).masked_fill(~keep, -inf), dim=-1)` in one pass, where
    keep = `mask` (bool, broadcastable to x, True = keep) and, with `causal=True`, column j of
    the last dim is dropped when j > i, the index in the second-to-last dim (top-left aligned,
    like `torch.tril(torch.ones(L, S))` and SDPA's `is_causal`; for S > L the extra keys at the
    end are masked, not the ones at the start).

    Shapes: x [..., S] (causal: [..., L, S]); output has x's shape and dtype (float32, float16,
    bfloat16); math in fp32, one rounding on store. Any strides are accepted.

    Differences from eager: a fully masked row (every position masked, or every kept logit -inf)
    gives zeros here, and NaN in eager; its gradient is zero. With `causal=True` the backward
    does not read dy past the diagonal (y is 0 there), so a NaN/inf there does not spread into
    the row's gradient as it does in eager. `scale` is a Python float (no grad).

    Backward: dx = scale * y * (dy - sum(dy * y)), reading y and dy once.
    """
    _check(x, mask, causal)
    if use_triton(x):
        return SoftmaxFunction.apply(x, mask, float(scale), bool(causal))
    warn_fallback("softmax", f"no Triton for tensors on {x.device} (set TRITON_INTERPRET=1 for the interpreter)")
    return softmax_reference(x, scale=scale, mask=mask, causal=causal)


# ---------------------------------------------------------------------------------------------
# 6. nn.Module drop-in
# ---------------------------------------------------------------------------------------------


class Softmax(torch.nn.Module):
    """`nn.Softmax(dim=-1)` with an optional fixed scale and causal mask; forward(x, mask=None)."""

    def __init__(self, scale: float = 1.0, causal: bool = False):
        super().__init__()
        self.scale = scale
        self.causal = causal

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return softmax(x, scale=self.scale, mask=mask, causal=self.causal)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"


# ---------------------------------------------------------------------------------------------
# 7. Reference
# ---------------------------------------------------------------------------------------------


def softmax_reference(
    x: torch.Tensor, *, scale: float = 1.0, mask: Optional[torch.Tensor] = None, causal: bool = False
) -> torch.Tensor:
    """Pure PyTorch, same semantics as `softmax` (fully masked rows give zeros), math in fp32
    (fp64 stays fp64), cast back to x's dtype."""
    z = x.to(torch.promote_types(x.dtype, torch.float32)) * scale
    keep = torch.ones_like(z, dtype=torch.bool) if mask is None else mask.expand(x.shape)
    if causal:
        q_len, k_len = x.shape[-2], x.shape[-1]
        keep = keep & torch.ones(q_len, k_len, dtype=torch.bool, device=x.device).tril()
    z = z.masked_fill(~keep, float("-inf"))
    dead = (z == float("-inf")).all(dim=-1, keepdim=True)
    # Dead rows get finite logits before the softmax (and zeros after) so neither the forward nor
    # the backward ever sees NaN.
    y = torch.softmax(z.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# 8. Registry
# ---------------------------------------------------------------------------------------------

# FLOPs per element: fwd scale-mul, max, subtract, exp, sum-add, normalize-mul = 6;
# bwd dy*y, sum-add, subtract, mul by y, mul by scale = 5. (exp counted as one op.)
_FWD_FLOPS, _BWD_FLOPS = 6, 5


def _cost(n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16, mask_numel: int = 0, **_) -> dict[str, Cost]:
    n, e = n_rows * n_cols, torch.empty((), dtype=dtype).element_size()
    return {
        "fwd": Cost(flops=_FWD_FLOPS * n, bytes=2 * n * e + mask_numel),  # read x (+ mask), write y
        "bwd": Cost(flops=_BWD_FLOPS * n, bytes=3 * n * e),  # read y, dy; write dx
    }


def _fwd_op_cost(metas: list[TensorMeta]) -> Cost:
    """metas: x and, when given, the mask (a None mask is not in the trace)."""
    n_rows, n_cols = rows_cols(metas[0].shape)
    mask_numel = math.prod(metas[1].shape) if len(metas) > 1 else 0
    return _cost(n_rows, n_cols, metas[0].dtype, mask_numel)["fwd"]


def _bwd_op_cost(metas: list[TensorMeta]) -> Cost:
    """metas: y, dy."""
    n_rows, n_cols = rows_cols(metas[0].shape)
    return _cost(n_rows, n_cols, metas[0].dtype)["bwd"]


SPEC = register(
    KernelSpec(
        name="softmax",
        replaces="x * scale, masked_fill(~mask, -inf) / causal tril mask, torch.softmax(dim=-1)",
        dtypes=DTYPES,
        limits=f"any shape; rows <= {MAX_FUSED_COLS} in registers, longer rows looped (one extra read of x "
        "and of y, dy); fully masked rows give 0, not NaN",
        deterministic=True,  # no atomics; fixed reduction order per config
        fn=softmax,
        module=Softmax,
        reference=softmax_reference,
        cost=_cost,
        op_costs={"kprof::softmax_fwd": _fwd_op_cost, "kprof::softmax_bwd": _bwd_op_cost},
    )
)

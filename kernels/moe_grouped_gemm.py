"""MoE experts as a Triton grouped GEMM with the SwiGLU fused into the first GEMM's epilogue:
`y = (silu(x W_g[e]) * (x W_u[e])) W_down[e]` for every row, e the row's expert, forward and
backward, without a host sync.

Why: `moe_experts` runs `torch._grouped_mm`, which is refused for some dtypes (fp16), strides
that are not 16-byte aligned, older torch and some GPUs; before this module those cases ran a
Python loop over experts that reads the offsets on the host (a sync per layer, 3 GEMMs per
expert). This is the fallback the issue asked for, and it also fuses the gated activation,
which `_grouped_mm` cannot: the [N, 2I] gate|up is never re-read to compute a.

Rows are in expert-contiguous order; `offsets` [E] int32 on the device holds each expert's
inclusive end (`moe_router`'s layout): expert e owns rows [offsets[e-1], offsets[e]).

Schedule (why this one): the grid is (row tiles of all N rows, column tiles), fixed by N and
the shapes alone, so nothing is read back to the host. Each row tile finds the experts it
overlaps by counting, in-kernel, the offsets at or below its first and last row (E values, one
vector load), and loops over those experts: for each, it runs the K loop with the A rows
outside that expert masked to zero, into one accumulator (the experts' row sets are disjoint,
so the sum is each row's own product). A tile inside one expert (every tile at Mixtral's 512
rows per expert and 128-row tiles) does one K loop, as a plain GEMM; a tile straddling a
boundary does one K loop per expert it touches, so the extra work is at most one tile-GEMM per
expert boundary (E - 1 per column tile), empty experts are skipped. The alternative, a tile
schedule built on the device (a prefix sum of per-expert tile counts, as in grouped GEMMs with
a padded grid), wastes no MMA on masked rows but needs an extra launch and a grid sized for
the worst case; at E - 1 extra tiles out of N / 128 it is not worth it here.
A caveat of the masking: a row tile multiplies masked (zero) rows by the other experts' weights,
so an inf or NaN in one expert's weights reaches the rows of neighbouring experts in that tile.

Kernels:
- `_rows_kernel` (grid over row and column tiles): the forward's x @ W_gate_up[e] with the
  SwiGLU epilogue (EPI 1), a @ W_down[e] (EPI 0), and in the backward dy @ W_down[e]^T with the
  SwiGLU backward in its epilogue (EPI 2, giving d[gate|up]) and dh @ W_gate_up[e]^T (EPI 0);
- `_weights_kernel` (grid over expert, K tile, N tile): dW[e] = A_e^T B_e, looping over expert
  e's rows (start and end read from the offsets on the device); for dW_down, A = a is
  recomputed from the saved gate|up inside the operand load. Fixed summation order, no atomics:
  bitwise deterministic.
Tiles (`_config`) are not timed on a GPU yet; compiled for sm_90 in the tests at the Mixtral
launch's specialisations, all six launches use wgmma, pipeline their loads and do not spill.

Saved for the backward: x and h = [gate|up] ([N, 2I], rounded to the input dtype), not a (the
activation, [N, I]), which the backward recomputes from h elementwise inside its loads, free
next to the GEMMs. That is 2I elements per row against the 3I (gate|up and a) the
`_grouped_mm` + `swiglu_packed` path saves; at Mixtral's layer (4096 rows, I 2816, bf16) 46 MB
per layer against 69 MB. Recomputing h as well would save those 46 MB for x @ W_gate_up again
in the backward (2/3 of the forward's FLOPs); not done.

Numerics: fp32 accumulation everywhere; `tl.dot(..., input_precision="ieee")` so fp32 inputs
stay fp32 (no TF32; "ieee" is accepted since Triton 3.0, run here on 3.9 only); bf16/fp16 use
their tensor-core MMA with fp32 accumulation either way. The epilogue rounds gate|up to the input dtype before the
activation, so the forward's a is exactly the a the backward recomputes from the saved h (and
the rounding is the one the `_grouped_mm` path does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels.common import (
    FP_FUSION,
    INTERPRETED,
    cast_rtne,
    cdiv,
    device_ctx,
    fast_math,
    kernel_op,
    launch,
    next_power_of_2,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels.glu import ACT_SILU, act_and_grad, act_fwd, swiglu_packed_reference
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SILU = tl.constexpr(ACT_SILU)

# Row-kernel epilogues (the EPI constexpr).
EPI_STORE = 0  # C = A @ B[e]
EPI_SWIGLU = 1  # h = A @ B[e] (gate and up column tiles), a = silu(gate) * up
EPI_SWIGLU_BWD = 2  # d a = A @ B[e], then d[gate|up] from the saved h


# --------------------------------------------------------------------------------------------
# 1. Triton kernels
# --------------------------------------------------------------------------------------------


# INTERP (a constexpr, True only under the interpreter) works around two interpreter bugs
# (Triton 3.9): bf16 dots (`_dot`) and fp32 -> bf16 casts that truncate (`cast_rtne`, which
# rounds to nearest even on the bits as the GPU does). The truncation is biased, so it adds up in
# these GEMMs: y of a 21-row bf16 expert was 1.29e-2 off fp64 in relative Frobenius norm with
# truncating casts, 3.3e-3 rounding to nearest (the loop's bf16 GEMMs: 3.8e-3).


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b in fp32. INTERP: operands to fp32 first, because the interpreter computes
    bf16 dots wrongly (a 16x16x16 bf16 dot of N(0, 1) values came out 2.4e10 off); products of
    bf16/fp16 values are exact in fp32, so this is the GPU's MMA math."""
    if INTERP:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _expert_bounds(offs_ptr, e):
    """(start, end) rows of expert e: offsets are inclusive ends, expert 0 starts at row 0."""
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    return start, tl.load(offs_ptr + e)


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, c_ptr, h_ptr, offs_ptr,
    n_rows, n_cols, k_dim, n_experts,
    s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_hm,  # strides in elements; c and h have unit column stride
    EPI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, INTERP: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """C[r, n] = sum_k A[r, k] B[e(r), k, n] on one [BLOCK_M, BLOCK_N] tile, e(r) row r's expert.
    EPI_STORE: C -> c. EPI_SWIGLU: B's column n (gate) and n_cols + n (up) -> h = [gate|up],
    c = silu(gate) * up. EPI_SWIGLU_BWD: C is d a; gate, up read from h; c = [d gate|d up]."""
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    col_ok = cols[None, :] < n_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # EPI_SWIGLU only (dropped otherwise)
    # The experts overlapping rows [m0, m_last]: first = the first with end > m0, last = the one
    # owning m_last (clamped: rows past offsets[-1] belong to none and stay 0).
    e_idx = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e_idx, mask=e_idx < n_experts, other=2147483647)
    m_last = tl.minimum(m0 + BLOCK_M, n_rows) - 1
    first = tl.sum((ends <= m0).to(tl.int32), 0)
    last = tl.minimum(tl.sum((ends <= m_last).to(tl.int32), 0), n_experts - 1)
    for j in range(0, last + 1 - first):
        e = first + j  # not `for e in range(first, ...)`: the interpreter makes that a Python int
        start, end = _expert_bounds(offs_ptr, e)
        if end > start:
            a_rows = (rows[:, None] >= start) & (rows[:, None] < end)
            b_e = b_ptr + e.to(tl.int64) * s_be
            for k0 in range(0, k_dim, BLOCK_K):
                k = k0 + kk
                a = tl.load(a_ptr + r64 * s_am + k[None, :] * s_ak, mask=a_rows & (k[None, :] < k_dim), other=0.0)
                b_ptrs = b_e + k[:, None].to(tl.int64) * s_bk + cols[None, :] * s_bn
                b_mask = (k[:, None] < k_dim) & col_ok
                acc = _dot(a, tl.load(b_ptrs, mask=b_mask, other=0.0), acc, INTERP)
                if EPI == 1:
                    acc_up = _dot(a, tl.load(b_ptrs + n_cols * s_bn, mask=b_mask, other=0.0), acc_up, INTERP)
    mask = (rows[:, None] < n_rows) & col_ok
    c_ptrs = c_ptr + r64 * s_cm + cols[None, :]
    if EPI == 0:
        tl.store(c_ptrs, cast_rtne(acc, c_ptr.dtype.element_ty, INTERP), mask=mask)
    elif EPI == 1:
        # Rounded to the storage dtype first: the backward recomputes a from this saved h.
        g = cast_rtne(acc, h_ptr.dtype.element_ty, INTERP)
        u = cast_rtne(acc_up, h_ptr.dtype.element_ty, INTERP)
        h_ptrs = h_ptr + r64 * s_hm + cols[None, :]
        tl.store(h_ptrs, g, mask=mask)
        tl.store(h_ptrs + n_cols, u, mask=mask)
        a = act_fwd(g.to(tl.float32), _SILU, FAST) * u.to(tl.float32)
        tl.store(c_ptrs, cast_rtne(a, c_ptr.dtype.element_ty, INTERP), mask=mask)
    else:
        h_ptrs = h_ptr + r64 * s_hm + cols[None, :]
        g = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptrs + n_cols, mask=mask, other=0.0).to(tl.float32)
        act, dact = act_and_grad(g, _SILU, FAST)
        tl.store(c_ptrs, cast_rtne(acc * u * dact, c_ptr.dtype.element_ty, INTERP), mask=mask)
        tl.store(c_ptrs + n_cols, cast_rtne(acc * act, c_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _weights_kernel(
    a_ptr, b_ptr, w_ptr, offs_ptr,
    k_dim, n_cols, gate_cols,
    s_am, s_ak, s_bm, s_bn, s_we, s_wk,  # strides in elements; w has unit column stride
    GATED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    INTERP: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """w[e, k, n] = sum over expert e's rows r of A[r, k] B[r, n], for e = program_id(0) and one
    [BLOCK_K, BLOCK_N] tile; an empty expert gets zeros. GATED: A = silu(h[:, k]) *
    h[:, gate_cols + k] from h at a_ptr, rounded to h's dtype (the forward's a, bit for bit)."""
    e = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    start, end = _expert_bounds(offs_ptr, e)
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for r0 in range(start, end, BLOCK_R):
        r = r0 + rr
        r64 = r.to(tl.int64)
        a_mask = (ks[:, None] < k_dim) & (r[None, :] < end)
        a_ptrs = a_ptr + r64[None, :] * s_am + ks[:, None] * s_ak  # A^T tile, [BLOCK_K, BLOCK_R]
        if GATED:
            g = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(a_ptrs + gate_cols * s_ak, mask=a_mask, other=0.0).to(tl.float32)
            at = cast_rtne(act_fwd(g, _SILU, FAST) * u, a_ptr.dtype.element_ty, INTERP)
        else:
            at = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptr + r64[:, None] * s_bm + ns[None, :] * s_bn,
                    mask=(r[:, None] < end) & (ns[None, :] < n_cols), other=0.0)
        acc = _dot(at, b, acc, INTERP)
    w_ptrs = w_ptr + e.to(tl.int64) * s_we + ks[:, None].to(tl.int64) * s_wk + ns[None, :]
    tl.store(w_ptrs, cast_rtne(acc, w_ptr.dtype.element_ty, INTERP), mask=(ks[:, None] < k_dim) & (ns[None, :] < n_cols))


# --------------------------------------------------------------------------------------------
# 2. Launchers
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _config(dtype: torch.dtype, epilogue: bool) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages); not timed on a GPU yet.
    16-bit: 128x128x64 tiles, 8 warps, 3 stages (3 x 32 KB of operand tiles in shared memory).
    The SwiGLU epilogues (`epilogue`) take 64 columns: the forward keeps two accumulators (gate,
    up), the backward loads gate and up beside its accumulator; at 128 columns the backward's
    used 255 registers and spilled 120 bytes (ptxas for sm_90a, from the sm_90 AOT compile in
    the tests), at 64 no 16-bit kernel spills. fp32 (IEEE: no tensor-core TF32): 64x64x32.
    The interpreter: 16-row, 16/32-column, 16-deep tiles, so the small test shapes have tiles
    straddling experts and partial K and column tiles."""
    if INTERPRETED:
        return 16, 16 if epilogue else 32, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32 if epilogue else 64, 32, 4, 3
    return 128, 64 if epilogue else 128, 64, 8, 3


def _launch_rows(a, b, c, h, offsets, n_cols: int, epi: int) -> None:
    """c (and h) from rows a [N, K] and per-expert b [E, K, *]: see `_rows_kernel`."""
    n_rows, k_dim = a.shape
    if n_rows == 0 or n_cols == 0:
        return
    bm, bn, bk, warps, stages = _config(a.dtype, epi != EPI_STORE)
    with device_ctx(c):
        launch(_rows_kernel, (cdiv(n_rows, bm), cdiv(n_cols, bn)),
            a, b, c, h, offsets, n_rows, n_cols, k_dim, offsets.numel(),
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
            h.stride(0) if h is not None else 0,
            EPI=epi, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=next_power_of_2(offsets.numel()),
            INTERP=INTERPRETED, FAST=fast_math(c), num_warps=warps, num_stages=stages, **FP_FUSION,
        )  # fmt: skip


def _launch_weights(a, b, w, offsets, gated: bool) -> None:
    """w [E, K, N] = per expert, A_e^T B_e with a [N_rows, K] (or h [N_rows, 2K] when gated)."""
    n_experts, k_dim, n_cols = w.shape
    if n_experts == 0 or k_dim == 0 or n_cols == 0:
        return
    bm, bn, bk, warps, stages = _config(a.dtype, False)
    with device_ctx(w):
        launch(_weights_kernel, (n_experts, cdiv(k_dim, bm), cdiv(n_cols, bn)),
            a, b, w, offsets, k_dim, n_cols, k_dim if gated else 0,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), w.stride(0), w.stride(1),
            GATED=gated, BLOCK_K=bm, BLOCK_N=bn, BLOCK_R=bk, INTERP=INTERPRETED, FAST=fast_math(w),
            num_warps=warps, num_stages=stages, **FP_FUSION,
        )  # fmt: skip


def _fwd(x, offsets, w_gate_up, w_down) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [N, H], h = [gate|up] [N, 2I]); h is what the backward needs besides x."""
    n, hidden = x.shape
    inter = w_down.shape[1]
    h = torch.empty(n, 2 * inter, dtype=x.dtype, device=x.device)
    a = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _launch_rows(x, w_gate_up, a, h, offsets, inter, EPI_SWIGLU)
    _launch_rows(a, w_down, y, None, offsets, hidden, EPI_STORE)
    return y, h


def _bwd(dy, x, offsets, h, w_gate_up, w_down) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d w_gate_up, d w_down), the weight grads accumulated in fp32 per expert."""
    inter = w_down.shape[1]
    dh = torch.empty_like(h)
    _launch_rows(dy, w_down.transpose(1, 2), dh, h, offsets, inter, EPI_SWIGLU_BWD)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rows(dh, w_gate_up.transpose(1, 2), dx, None, offsets, x.shape[1], EPI_STORE)
    dw_gate_up = torch.empty(w_gate_up.shape, dtype=w_gate_up.dtype, device=x.device)
    _launch_weights(x, dh, dw_gate_up, offsets, gated=False)
    dw_down = torch.empty(w_down.shape, dtype=w_down.dtype, device=x.device)
    _launch_weights(h, dy, dw_down, offsets, gated=True)
    return dx, dw_gate_up, dw_down


# --------------------------------------------------------------------------------------------
# 3. torch.library ops (see common.kernel_op) and the autograd.Function
# --------------------------------------------------------------------------------------------


@kernel_op("kprof::moe_grouped_gemm_fwd")
def _fwd_op(x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(x, offsets, w_gate_up, w_down)


@kernel_op("kprof::moe_grouped_gemm_bwd")
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, h: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, offsets, h, w_gate_up, w_down)


@_fwd_op.register_fake
def _(x, offsets, w_gate_up, w_down):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], w_gate_up.shape[2])


@_bwd_op.register_fake
def _(dy, x, offsets, h, w_gate_up, w_down):
    return x.new_empty(x.shape), w_gate_up.new_empty(w_gate_up.shape), w_down.new_empty(w_down.shape)


class _GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, w_gate_up, w_down):
        y, h = (_fwd_op if via_custom_op() else _fwd)(x, offsets, w_gate_up, w_down)
        ctx.save_for_backward(x, offsets, h, w_gate_up, w_down)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offsets, h, w_gate_up, w_down = ctx.saved_tensors
        dx, dwgu, dwd = (_bwd_op if via_custom_op() else _bwd)(dy, x, offsets, h, w_gate_up, w_down)
        return dx, None, dwgu, dwd


# --------------------------------------------------------------------------------------------
# 4. Public function and reference
# --------------------------------------------------------------------------------------------


def check_experts_args(x, offsets, w_gate_up, w_down) -> None:
    """Shapes and dtypes of an experts call (shared with `moe_experts`)."""
    if x.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3 or offsets.dim() != 1:
        raise KprofError(f"moe_experts: x [N, H], offsets [E], w_gate_up [E, H, 2I], w_down [E, I, H] expected; got "
                         f"{tuple(x.shape)}, {tuple(offsets.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    e, h, i2 = w_gate_up.shape
    if x.shape[1] != h or w_down.shape != (e, i2 // 2, h) or i2 % 2 or offsets.numel() != e:
        raise KprofError(f"moe_experts: shapes disagree: x {tuple(x.shape)}, offsets {tuple(offsets.shape)}, "
                         f"w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise KprofError(f"moe_experts: x and weights must share a dtype of {SUPPORTED_DTYPES}")
    if not (offsets.device == w_gate_up.device == w_down.device == x.device):
        raise KprofError(f"moe_experts: x, offsets and weights must be on one device, got {x.device}, "
                         f"{offsets.device}, {w_gate_up.device}, {w_down.device}")


def moe_grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor) -> torch.Tensor:
    """[N, H] expert outputs for rows x [N, H] in expert-contiguous order (expert e owns rows
    [offsets[e-1], offsets[e]); rows past offsets[-1] get zeros), w_gate_up [E, H, 2I] (gate
    first), w_down [E, I, H]; any strides. Differentiable in x and both weights; no host sync."""
    check_experts_args(x, offsets, w_gate_up, w_down)
    if not use_triton(x):
        warn_fallback("moe_grouped_gemm", f"no Triton backend for {x.device.type} tensors")
        return moe_grouped_gemm_reference(x, offsets, w_gate_up, w_down)
    return _GroupedGemmFunction.apply(x, offsets.to(torch.int32).contiguous(), w_gate_up, w_down)


def moe_grouped_gemm_reference(x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor,
                               w_down: torch.Tensor, act=swiglu_packed_reference) -> torch.Tensor:
    """A loop over experts (reads the offsets on the host: a sync, as eager HF code has). `act`:
    the gated activation on [rows, 2I] (tests pass `swiglu_packed` to round where the kernels
    round)."""
    ends = offsets.tolist()
    outs, start = [], 0
    for e, end in enumerate(ends):
        rows = x[start:end]
        outs.append(act(rows @ w_gate_up[e]) @ w_down[e])
        start = end
    return torch.cat(outs) if outs else x.new_empty(0, w_down.shape[2])


# --------------------------------------------------------------------------------------------
# 5. Registry
# --------------------------------------------------------------------------------------------


def _cost(n_rows: int, hidden: int, inter: int, n_experts: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Cost]:
    """n_rows = T * k routed rows. Forward: the weights (W = 3HI per expert) and x read; h [N, 2I]
    and a [N, I] written, a read back; y written. Backward: the weights read and their grads
    written; dy read twice (d a, d w_down), x once (d w_gate_up), h twice (the SwiGLU backward,
    a for d w_down); dh [N, 2I] written once and read twice (dx, d w_gate_up); dx written."""
    b = dtype.itemsize
    nh, ni, w = n_rows * hidden, n_rows * inter, n_experts * 3 * hidden * inter
    gemm = 2 * nh * 3 * inter
    return {
        "fwd": Cost(flops=gemm, bytes=b * (w + nh + 2 * ni + 2 * ni + nh)),
        "bwd": Cost(flops=2 * gemm, bytes=b * (2 * w + 2 * nh + nh + 2 * 2 * ni + 3 * 2 * ni + nh)),
    }


def _op_cost(metas: list[TensorMeta], direction: str) -> Cost:
    x, w_down = (metas[0], metas[3]) if direction == "fwd" else (metas[1], metas[5])
    n_experts, inter, hidden = w_down.shape
    return _cost(x.shape[0], hidden, inter, n_experts, x.dtype)[direction]


MOE_GROUPED_GEMM_SPEC = register(KernelSpec(
    name="moe_grouped_gemm",
    replaces="a loop over experts of down(silu(x W_gate) * (x W_up)) (moe_experts' fallback where "
             "torch._grouped_mm is refused)",
    dtypes=SUPPORTED_DTYPES,
    limits="rows in expert-contiguous order with int32 device offsets; any strides; a row tile straddling "
           "k experts runs k masked K loops; block sizes not tuned on a GPU",
    deterministic=True,  # fixed-order loops, no atomics (weight grads per expert in one program)
    fn=moe_grouped_gemm, module=None, reference=moe_grouped_gemm_reference, cost=_cost,
    op_costs={
        "kprof::moe_grouped_gemm_fwd": lambda metas: _op_cost(metas, "fwd"),
        "kprof::moe_grouped_gemm_bwd": lambda metas: _op_cost(metas, "bwd"),
    },
))


__all__ = ["check_experts_args", "moe_grouped_gemm", "moe_grouped_gemm_reference"]

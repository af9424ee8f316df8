"""Bias + GELU: `F.gelu(x + bias, approximate)` in one pass, the epilogue of a GPT-2 MLP's c_fc
when the matmul runs without its bias.

Eager: `x + bias` (read x, write t) then `gelu(t)` (read t, write y): 4 passes forward; the
backward reads dy and t, writes dt, then reduces dt over rows for dbias (another read). Fused:
forward reads x and writes y (2 passes; the bias is N elements); backward reads dy and x,
recomputes gelu'(x + bias) and writes dx (3 passes), and sums dbias on the fly.

dbias = sum over rows of dx: each program of a persistent grid (_PROGRAMS_PER_SM per SM) owns one
column block and a strided set of row tiles, accumulates in registers (fp64 for fp32 inputs, fp32
for half ones) and writes one fp64 partial row to an [n_groups, N] buffer; `partial.sum(0)` (fp64)
finishes and rounds once to bias's dtype. No atomics, so the result is bitwise run-to-run
deterministic. Partial traffic at 16384x16384 bf16 on an H200: 66 groups x 16384 fp64 = 8.7 MB
written and read back, 0.5% of the backward's 1.61 GB stream.

Why the kernels look the way they do: x 16384x16384 bf16 (537 MB per tensor) moves 1.07 GB forward
(251 us floor at 4.27 TB/s) and 1.61 GB backward (377 us), but the kernels are issue-bound, not
DRAM-bound (ncu, H200: backward 69% SM vs 50% DRAM throughput): at copy bandwidth an SM can issue
only ~47 instructions per element of the backward and ~31 of the forward. So every instruction per
element is counted (benchmarks/sass_count.py): exps as one ex2 with log2(e) folded into the
constants (`exp2_fast`), 1 / x as rcp.approx (`rcp_fast`), bf16 loads widened by shift and mask
(`to_f32_fast`), pointers advanced per row tile, a 2-D grid (`common.stream_tile`), glu's erf
tail on one exp, fp32 dbias accumulators for half inputs and register caps that keep
every program resident (BWD_MAXNREG, FWD_MAXNREG). Measured on the H200 at 16384x16384 bf16:
fwd+bwd 660 us with tanh (95% of copy bandwidth) and 668 us with erf (94%), forward 252-261 us
(96%). The history of those figures is in docs/kernels.md.

Numerics: x + bias and GELU computed in fp32 and rounded once (eager rounds x + bias to the
input dtype first); dbias is summed in fp64 from the unrounded fp32 dx. The activation math is
the shared `act_and_grad` from `kprof.kernels.glu`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels.common import (
    FP_FUSION,
    StreamConfig,
    cdiv,
    device_ctx,
    fast_math,
    kernel_op,
    launch,
    new_out,
    load_f32,
    numel,
    persistent_programs,
    rows_and_stride,
    store_cast,
    stream_plan,
    stream_tile,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels.glu import GELU_ACT, SUPPORTED_DTYPES, act_and_grad, act_fwd, approx_act
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

# --------------------------------------------------------------------------------------------
# 1. Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _bias_gelu_fwd_kernel(
    x_ptr, b_ptr, y_ptr,
    n_rows, n_cols,
    stride_x, stride_y,  # row strides in elements; columns have stride 1
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN: tl.constexpr,  # n_rows % BLOCK_M == 0 and n_cols % BLOCK_N == 0: no masks
    FAST: tl.constexpr,  # exp via ex2.approx.ftz (kprof.kernels._math); False in the interpreter
):  # fmt: skip
    for pid_m in range(tl.program_id(1), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(1)):  # see stream_tile
        rows, cols, mask = stream_tile(pid_m, n_rows, n_cols, BLOCK_M, BLOCK_N)
        r = rows[:, None]
        c = cols[None, :]
        b = load_f32(b_ptr + cols, cols < n_cols, EVEN, FAST)
        x = load_f32(x_ptr + r * stride_x + c, mask, EVEN, FAST)
        store_cast(y_ptr + r * stride_y + c, act_fwd(x + b[None, :], ACT, FAST), mask, EVEN)


@triton.jit
def _bias_gelu_bwd_kernel(
    dy_ptr, x_ptr, b_ptr, dx_ptr, part_ptr,
    n_rows, n_cols,
    stride_dy, stride_x, stride_dx,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, FAST: tl.constexpr,
    ACC_F64: tl.constexpr,  # dbias accumulated in fp64 (fp32 inputs) or fp32 (half inputs)
):  # fmt: skip
    # grid = (column blocks, groups): this program owns columns [pid_n * BLOCK_N, +BLOCK_N) and
    # row tiles pid_g, pid_g + n_groups, ... (n_mine of them); it writes dx for them and one fp64
    # partial dbias row.
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    n_groups = tl.num_programs(1)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    b = load_f32(b_ptr + cols, col_mask, EVEN, FAST)
    n_mine = tl.cdiv(tl.cdiv(n_rows, BLOCK_M) - pid_g, n_groups)
    # Addressing: loop-invariant int64 offsets within a tile plus one scalar pointer per tensor,
    # advanced by a row step per tile, instead of an int64 r * stride per tile (6 SASS
    # instructions per tensor per tile: sign extension, two IMADs for the 64-bit product, IADD3,
    # LEA, LEA.HI.X; now 2-3). Scalars, not pointer tensors, carried through the loops: carried
    # pointer tensors in the nested loop came out of Triton 3.9 with shared-memory layout
    # conversions every tile (24 STS.64 + 6 BAR.SYNC per tile; sm_90a).
    m = tl.arange(0, BLOCK_M)[:, None].to(tl.int64)
    off_dy = m * stride_dy + cols[None, :]
    off_x = m * stride_x + cols[None, :]
    off_dx = m * stride_dx + cols[None, :]
    row0 = pid_g * BLOCK_M  # first row of the current tile (masked path only)
    step = n_groups * BLOCK_M
    step_dy = step.to(tl.int64) * stride_dy  # int64: n_groups * BLOCK_M * stride may pass 2^31
    step_x = step.to(tl.int64) * stride_x
    step_dx = step.to(tl.int64) * stride_dx
    first = row0.to(tl.int64)
    dy_row = dy_ptr + first * stride_dy
    x_row = x_ptr + first * stride_x
    dx_row = dx_ptr + first * stride_dx
    # dbias accumulator. fp32 inputs: fp64, since a plain fp32 one walking 20000 rows (H200 test,
    # 4097 columns) drifted past the fp32 tolerance on columns whose dbias is near 0 (the error
    # grows with the row count, not with |dbias|); adding fp32 blocks of tiles into fp64 instead
    # was slower (722-756 us against 660 us tanh fwd+bwd). bf16/fp16 inputs: fp32, as rms_norm's
    # half dweight partials: the per-program sum over ~250 rows at 16384 rows (66 groups) carries
    # ~1e-5 relative error, 300x under a bf16 ulp of the result, and the partials are still summed
    # in fp64. Per element it is one FADD instead of F2F.F64.F32 + DADD (F2F on the 16/clk/SM pipe).
    if ACC_F64:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _k in range(0, n_mine):
        mask = (row0 + m < n_rows) & col_mask[None, :]
        dy = load_f32(dy_row + off_dy, mask, EVEN, FAST)
        x = load_f32(x_row + off_x, mask, EVEN, FAST)
        _, da = act_and_grad(x + b[None, :], ACT, FAST)
        dx = dy * da  # masked lanes: dy = 0 -> dx = 0, so they add nothing to acc
        store_cast(dx_row + off_dx, dx, mask, EVEN)
        acc += dx.to(acc.dtype)
        dy_row += step_dy
        x_row += step_x
        dx_row += step_dx
        row0 += step
    tl.store(part_ptr + pid_g.to(tl.int64) * n_cols + cols, tl.sum(acc, axis=0).to(tl.float64), mask=col_mask)


# --------------------------------------------------------------------------------------------
# 2. Launchers
# --------------------------------------------------------------------------------------------

# Persistent backward grid: about this many programs per SM (8 programs x 8 warps = 64 warps,
# the H100/H200 per-SM maximum) so one wave keeps every SM streaming.
_PROGRAMS_PER_SM = 4
# Backward tile (elements per program per row step) and warps; None: the forward's streaming
# plan (4096 elements, 8 warps). The dbias accumulator's registers grow with the tile, so the
# tile sets how many programs fit an SM. Swept by benchmarks.cases.glu.
BWD_TILE: int | None = 2048
BWD_WARPS: int | None = 8
# Register cap for the backward (ptxas .maxnreg; None: ptxas's choice). 65536 registers per SM /
# (_PROGRAMS_PER_SM 4 x 8 warps x 32 threads) = 64, so every program of the persistent grid is
# resident at once (an uncapped kernel over 64 registers runs 3 programs per SM and a second wave
# for the fourth). No spills at the default tile (the sm_90 compile test checks). H200: erf
# fwd+bwd 780 -> 769 us with the cap, tanh 660 either way.
BWD_MAXNREG: int | None = 64
# Forward launch: elements per program (None: StreamConfig.TILE, 4096; 4 warps below 4096) and
# register cap for bf16/fp16 inputs (None: ptxas's choice). Uncapped, the erf forward takes 38
# registers and fewer of its programs fit an SM. H200 at 16384x16384 bf16, tile 2048: tanh
# 252.5 us either way, erf 279.6 -> 261.4 us capped at 32 (96.2% of copy bandwidth).
FWD_TILE: int | None = 2048
FWD_MAXNREG: int | None = 32


def _bwd_plan(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    cfg = StreamConfig.streaming(n_rows, n_cols, BWD_TILE)
    return cfg.block_m, cfg.block_n, BWD_WARPS or cfg.num_warps


def _n_groups(t: torch.Tensor, n_row_tiles: int, n_col_blocks: int) -> int:
    return persistent_programs(n_row_tiles, t.device, _PROGRAMS_PER_SM, n_col_blocks)


def _check(x: torch.Tensor, bias: torch.Tensor) -> None:
    for name, t in (("x", x), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise KprofError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise KprofError(
                f"{name} has dtype {t.dtype}; bias_gelu supports float32, float16 and bfloat16"
            )
    if x.dim() == 0:
        raise KprofError("x is a 0-d tensor; expected shape [..., N]")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise KprofError(
            f"bias must have shape (N,) = ({x.shape[-1]},) for x of shape {tuple(x.shape)}, "
            f"got {tuple(bias.shape)}"
        )
    if bias.dtype != x.dtype:
        raise KprofError(
            f"x and bias must have the same dtype, got {x.dtype} and {bias.dtype} "
            f"(eager x + bias would promote to {torch.promote_types(x.dtype, bias.dtype)}; cast one first)"
        )
    if bias.device != x.device:
        raise KprofError(f"x and bias must be on the same device, got {x.device} and {bias.device}")


# The unchecked launchers are the eager hot path (the autograd.Function calls them directly; see
# `via_custom_op`): no aten work beyond allocating outputs, contiguous x passed as it is (no
# .view), views only for strided inputs (`rows_and_stride`).


def _fwd(x: torch.Tensor, bias: torch.Tensor, act: int) -> torch.Tensor:
    y = new_out(x)
    numel = y.numel()
    if numel == 0:
        return y
    n = x.shape[-1]
    n_rows = numel // n
    x2, sx = rows_and_stride(x, n)
    b = bias if bias.is_contiguous() else bias.contiguous()
    grid, bm, bn, warps = stream_plan(n_rows, n, FWD_TILE)
    with device_ctx(x):
        launch(_bias_gelu_fwd_kernel, grid,
            x2, b, y, n_rows, n, sx, n,
            ACT=act, BLOCK_M=bm, BLOCK_N=bn, EVEN=n_rows % bm == 0 and n % bn == 0, FAST=fast_math(x), num_warps=warps,
            maxnreg=FWD_MAXNREG if x.element_size() == 2 else None,
            **FP_FUSION,
        )  # fmt: skip
    return y


def _bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    dx = new_out(x)
    numel = dx.numel()
    if numel == 0:
        return dx, torch.zeros_like(bias)  # a sum over zero rows is 0
    n = x.shape[-1]
    n_rows = numel // n
    dy2, sdy = rows_and_stride(dy, n)
    x2, sx = rows_and_stride(x, n)
    b = bias if bias.is_contiguous() else bias.contiguous()
    bm, bn, warps = _bwd_plan(n_rows, n)
    n_col_blocks = cdiv(n, bn)
    n_groups = _n_groups(x, cdiv(n_rows, bm), n_col_blocks)
    partial = torch.empty(n_groups, n, dtype=torch.float64, device=x.device)  # sizes as ints: see new_out
    with device_ctx(x):
        launch(_bias_gelu_bwd_kernel, (n_col_blocks, n_groups),
            dy2, x2, b, dx, partial, n_rows, n, sdy, sx, n,
            ACT=act, BLOCK_M=bm, BLOCK_N=bn, EVEN=n_rows % bm == 0 and n % bn == 0, FAST=fast_math(x),
            ACC_F64=x.dtype == torch.float32, num_warps=warps, maxnreg=BWD_MAXNREG,
            **FP_FUSION,
        )  # fmt: skip
    # Second level: a fixed-order fp64 sum over n_groups partial rows (deterministic), then one
    # rounding to bias's dtype.
    return dx, partial.sum(dim=0).to(bias.dtype)


def bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """y = gelu(x + bias), contiguous, x's shape and dtype."""
    _check(x, bias)
    return _fwd(x, bias, approx_act(approximate))


def bias_gelu_bwd(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias): dx contiguous in x's shape and dtype, dbias in bias's dtype."""
    _check(x, bias)
    act = approx_act(approximate)
    if dy.shape != x.shape or dy.dtype != x.dtype or dy.device != x.device:
        raise KprofError(
            f"dy must have x's shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}; "
            f"got {tuple(dy.shape)}, {dy.dtype} on {dy.device}"
        )
    return _bwd(dy, x, bias, act)


# --------------------------------------------------------------------------------------------
# 3. Custom ops, 4. autograd.Function
# --------------------------------------------------------------------------------------------


@kernel_op("kprof::bias_gelu_fwd")
def _bias_gelu_fwd_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return bias_gelu_fwd(x, bias, approximate)


@_bias_gelu_fwd_op.register_fake
def _(x, bias, approximate):
    return x.new_empty(x.shape)


@kernel_op("kprof::bias_gelu_bwd")
def _bias_gelu_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return bias_gelu_bwd(dy, x, bias, approximate)


@_bias_gelu_bwd_op.register_fake
def _(dy, x, bias, approximate):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


class _BiasGELUFunction(torch.autograd.Function):
    # Eager: the unchecked launchers (bias_gelu validated the inputs; autograd's dy matches y).
    # Under torch.compile or a recording profiler: the custom ops (see `via_custom_op`).
    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        if via_custom_op():
            return _bias_gelu_fwd_op(x, bias, approximate)
        return _fwd(x, bias, GELU_ACT[approximate])

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        if via_custom_op():
            dx, dbias = _bias_gelu_bwd_op(dy, x, bias, ctx.approximate)
        else:
            dx, dbias = _bwd(dy, x, bias, GELU_ACT[ctx.approximate])
        return dx, dbias, None


# --------------------------------------------------------------------------------------------
# 5. Public function, 6. module, 7. reference
# --------------------------------------------------------------------------------------------


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """`F.gelu(x + bias, approximate=approximate)`, fused; differentiable in x and bias.

    x: [..., N], any strides; bias: [N]; same dtype (float32, float16, bfloat16) and device.
    approximate: "tanh" (default: GPT-2's gelu_new) or "none" (erf GELU, nn.GELU()'s default).
    Returns a contiguous tensor of x's shape and dtype. Computes x + bias and the GELU in fp32
    and rounds once (eager rounds x + bias first; results differ by at most about one ulp).
    """
    _check(x, bias)
    approx_act(approximate)
    if use_triton(x):
        return _BiasGELUFunction.apply(x, bias, approximate)
    warn_fallback("bias_gelu", f"no Triton backend for {x.device.type} tensors")
    return bias_gelu_reference(x, bias, approximate)


class BiasGELU(nn.Module):
    """`gelu(x + bias)` with its own bias Parameter: the epilogue of a bias-free up-projection
    (e.g. GPT-2's c_fc with its bias moved here)."""

    def __init__(self, n: int, approximate: str = "tanh", device=None, dtype=None):
        super().__init__()
        approx_act(approximate)
        self.approximate = approximate
        self.bias = nn.Parameter(torch.zeros(n, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{self.bias.shape[0]}, approximate={self.approximate!r}"


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The eager formulation, in the input dtype."""
    return F.gelu(x + bias, approximate=approximate)


# --------------------------------------------------------------------------------------------
# 8. Registry
# FLOPs per element (one per add/mul/div and per exp/erf, as in glu.py): forward = bias add +
# GELU (tanh 10: g^3 2, polynomial 2, scale 1, sigmoid 4, g*s 1; erf 5); backward = bias add +
# GELU + derivative (tanh 8, erf 6) + dy*gelu' + the dbias add: tanh 21, erf 14.
# --------------------------------------------------------------------------------------------

_FLOPS_PER_ELEM = {"tanh": (11, 21), "none": (6, 14)}  # (fwd, bwd)


def _cost(n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16, approximate: str = "tanh") -> dict[str, Cost]:
    """x is n_rows x n_cols, bias n_cols, all of `dtype`."""
    approx_act(approximate)
    b, mn = dtype.itemsize, n_rows * n_cols
    f_fwd, f_bwd = _FLOPS_PER_ELEM[approximate]
    return {
        # read x, bias; write y
        "fwd": Cost(flops=f_fwd * mn, bytes=b * (2 * mn + n_cols)),
        # read dy, x, bias; write dx, dbias
        "bwd": Cost(flops=f_bwd * mn, bytes=b * (3 * mn + 2 * n_cols)),
    }


def _op_cost(metas: Sequence[TensorMeta], which: str) -> Cost:
    # fwd metas: (x, bias); bwd: (dy, x, bias). `approximate` is not in the metas: cost as tanh
    # (the default, and the larger FLOP count); bytes are exact either way.
    x, bias = metas[-2], metas[-1]
    n = int(bias.shape[0]) if bias.shape else 1
    return _cost(numel(x.shape) // max(n, 1), n, x.dtype)[which]


SPEC = register(
    KernelSpec(
        name="bias_gelu",
        replaces="F.gelu(x + bias, approximate) (GPT-2 MLP c_fc epilogue, matmul done without bias)",
        dtypes=SUPPORTED_DTYPES,
        limits="x [..., N] any strides (non-unit last-dim strides are copied first), bias [N] of "
        "x's dtype; any N (rows are split into column blocks)",
        deterministic=True,  # dbias: fixed-order partial sums, no atomics
        fn=bias_gelu,
        module=BiasGELU,
        reference=bias_gelu_reference,
        cost=_cost,
        op_costs={
            "kprof::bias_gelu_fwd": lambda metas: _op_cost(metas, "fwd"),
            "kprof::bias_gelu_bwd": lambda metas: _op_cost(metas, "bwd"),
        },
    )
)

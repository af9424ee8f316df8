"""SwiGLU and GeGLU: `act(gate) * up` in one pass over memory, forward and backward.

Eager HF code (LlamaMLP, GemmaMLP) writes `act_fn(gate_proj(x)) * up_proj(x)`: one kernel for
the activation (read gate, write a) and one for the product (read a and up, write y), so 5
tensor passes forward and, with autograd saving `a`, about 9 backward. The fused kernels here
read gate and up once and write y once (3 passes); the backward recomputes the activation from
gate instead of saving it and reads dy, gate, up and writes d_gate, d_up (5 passes).

Napkin math (H200, 4.27 TB/s measured copy bandwidth), gate, up 8192x11008 bf16, E = 90.2M
elements: forward 3 * 2E bytes = 541 MB -> 127 us floor; backward 5 * 2E = 902 MB -> 211 us;
forward+backward 338 us. Measured on the H200: SwiGLU fwd 125 us (at the copy floor), fwd+bwd
332.5 us at a 1024-element tile (`GLU_TILE`; torch.compile 332.7 us), GeGLU(tanh) 333.4 us.

Two calling conventions:
- separate: `swiglu(gate, up)`, `geglu(gate, up, approximate=...)`, gate and up of equal shape
  [..., I] (non-contiguous views accepted, e.g. the two halves of a fused projection);
- packed: `swiglu_packed(gu)`, `geglu_packed(gu, approximate=...)`, gu of shape [..., 2*I] with
  the GATE in the FIRST half and UP in the SECOND: gate = gu[..., :I], up = gu[..., I:]
  (the layout of `gu.chunk(2, dim=-1)` -> (gate, up), as in Phi-3's gate_up_proj). The
  backward returns one d_gu of the same [..., 2*I] layout.

Numerics: the kernels upcast to fp32, compute the activation and the product in fp32 and round
once to the input dtype. Eager bf16 rounds twice (after the activation, after the product), so
the kernel is at least as close to the fp32 result as eager is; the `*_reference` functions are
the eager formulation (what `apply` compares against and what the CPU fallback runs).

Layers, in order: Triton kernels, launchers, torch.library custom ops, autograd.Functions,
public functions, references, registry specs. The activation helpers (`act_and_grad`,
`act_fwd`, `approx_act`, `GELU_ACT`) are also used by `kprof.kernels.bias_gelu`; the tile
helpers both use (`stream_tile`, `load_f32`, `store_cast`) live in `kprof.kernels.common`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels.common import (
    FP_FUSION,
    StreamConfig,  # noqa: F401  (re-exported: tests and benchmarks reach it as glu.StreamConfig)
    as_rows,
    device_ctx,
    fast_math,
    kernel_op,
    launch,
    new_out,
    load_f32,
    numel,
    store_cast,
    stream_plan,
    stream_tile,
    use_triton,
    via_custom_op,
    warn_fallback,
)
from kprof.kernels._math import LOG2E, exp2_fast, rcp_fast
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

# Activation codes passed to the kernels as the ACT constexpr.
ACT_SILU = 0
ACT_GELU_TANH = 1
ACT_GELU_ERF = 2
GELU_ACT = {"tanh": ACT_GELU_TANH, "none": ACT_GELU_ERF}

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# 1. Triton kernels
# --------------------------------------------------------------------------------------------


# Constants of the activations with log2(e) folded in, so each exp is one ex2 (`exp2_fast`)
# with no FMUL for the scaling (ptxas, sm_90a: 1-2 instructions per element; see act_and_grad).
_S8P = 1.5957691216057308  # 2 * sqrt(2/pi) = sqrt(8/pi): tanh GELU's sigmoid(2z) argument scale
_SQRT_8_OVER_PI = tl.constexpr(_S8P)
_TANH_K1 = tl.constexpr(_S8P * LOG2E.value)  # u * log2(e) = g * (K1 + K3 * g^2)
_TANH_K3 = tl.constexpr(_S8P * 0.044715 * LOG2E.value)
_TANH_DK3 = tl.constexpr(_S8P * 3 * 0.044715)  # u' = sqrt(8/pi) + DK3 * g^2
# erf GELU: -g^2/2 in log2 units, plus log2(1/sqrt(2 pi)) (phi's normalization): q = g^2 * Q2 + Q0
_ERF_Q2 = tl.constexpr(-0.5 * LOG2E.value)
_ERF_Q0 = tl.constexpr(-0.5 * math.log2(2 * math.pi))
# Phi(-z sqrt 2) = 0.5 erfc(z) = t * P(t) * phi(g), t = 1 / (1 + p z), z = |g| / sqrt(2): P is a
# degree-7 fit of 0.5 sqrt(2 pi) erfcx(z) / t over z in [0, 9.5] (past it phi(g) < 2^-126, flushed
# to zero), minimax in relative error, p chosen with it: benchmarks/fit_erfc.py. Fit error
# 8.4e-8 relative in float64.
_ERFC_P = 0.42998064811070746
_ERFC_T = tl.constexpr(_ERFC_P / math.sqrt(2))  # t = 1 / (1 + |g| * T)
_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7 = (tl.constexpr(c) for c in (
    0.30393307956662247, 0.3062692312662526, 0.2568328097980125, 0.30946342716468983,
    -0.10762277024042248, 0.48112944025314486, -0.389075795421637, 0.09238481985837788,
))  # fmt: skip


@triton.jit
def _gelu_erf_parts(g, FAST: tl.constexpr):
    """(h / pdf, pdf) for an fp32 block g: h = Phi(-|g|) = 0.5 * erfc(|g| / sqrt(2)) <= 0.5 and
    pdf = phi(g) = exp(-g^2 / 2) / sqrt(2 pi), each with relative error ~1e-6 everywhere.

    h = t * P(t) * pdf with t = 1 / (1 + p |g| / sqrt(2)) and P the degree-7 fit above: phi's
    exp serves both values, and the tail needs no exp of its own (one exp per element: the
    bias_gelu kernels are issue-bound, see there). Error in fp32, emulated (numpy; FMA Horner,
    ex2 within 2^-22): h 7e-7 relative for g in [-4, 0], growing as |q| * 2^-24 (the rounding of
    phi's exponent) to 5e-6 at g = -10. In the interpreter (exact exp), over g in [-4, 9]: geglu
    8.3e-7 relative, its derivative for g > 0 3.2e-7. Used instead of 0.5 * (1 + erf(-z)), which
    cancels: at g = -3 the CDF is 1.3e-3 and 1 + erf carries erf's absolute error of ~6e-8, a
    relative error of 4.4e-5 (770 fp32 ulp; enough to flip 1.3% of bf16 roundings of geglu(erf)
    at g ~ 3 N(0, 1) on the H200).
    """
    t = rcp_fast(1.0 + tl.abs(g) * _ERFC_T, FAST)
    p = _P7 * t + _P6
    p = p * t + _P5
    p = p * t + _P4
    p = p * t + _P3
    p = p * t + _P2
    p = p * t + _P1
    p = p * t + _P0
    pdf = exp2_fast(g * g * _ERF_Q2 + _ERF_Q0, FAST)
    return t * p, pdf  # h = (t * p) * pdf


@triton.jit
def act_and_grad(g, ACT: tl.constexpr, FAST: tl.constexpr):
    """(act(g), act'(g)) for an fp32 block g. ACT: 0 silu, 1 gelu tanh, 2 gelu erf.

    Forward kernels use only the first value; the compiler drops the unused derivative.
    Written without cancellation, so both values carry a few fp32 ulp of relative error for
    every g: the backward of bias_gelu sums act' over all rows into dbias, where per-element
    absolute errors of ~1e-6 (what `s + g * s * (1 - s)` gives at g = 5, because 1 - s loses
    the digits of s ~ 1) added up past the fp32 tolerance at 1823 rows on the H200.
    SASS per element of bias_gelu's backward loop (sm_90a, FAST; benchmarks/sass_count.py): see
    the table in kernels/bias_gelu.py.
    """
    if ACT == 2:
        # gelu(g) = g * Phi(g); gelu'(g) = Phi(g) + g * phi(g). h = Phi(-|g|) <= 0.5 and
        # Phi(g) = 1 - h for g >= 0, so no 1 + erf cancellation on either side.
        h_pdf, pdf = _gelu_erf_parts(g, FAST)
        h = h_pdf * pdf
        cdf = tl.where(g >= 0, 1.0 - h, h)
        a = g * cdf
        da = cdf + g * pdf
    else:
        if ACT == 1:
            # tanh GELU: 0.5 * g * (1 + tanh(z)), z = sqrt(2/pi) * (g + 0.044715 g^3).
            # 0.5 * (1 + tanh(z)) == sigmoid(2z), so gelu_tanh(g) = g * sigmoid(u), u = 2z: the
            # same shape as silu, with no 1 + tanh cancellation for very negative g and no tanh
            # (not in tl.math on Triton 3.6). u * log2(e) and u' in Horner form on g^2, the
            # constants pre-multiplied (each rounded once to fp32: 2^-24 relative).
            g2 = g * g
            k = _TANH_K1 + _TANH_K3 * g2  # u * log2(e) / g > 0
            du = _SQRT_8_OVER_PI + _TANH_DK3 * g2
        else:
            k = LOG2E
            du = 1.0
        # s = sigmoid(u) and s * (1 - s) from e = exp(-|u|) = 2^(-|g| k) <= 1 (never overflows):
        # s = 1 / (1 + e) for u >= 0, e / (1 + e) below; s * (1 - s) = e / (1 + e)^2.
        # -|g| * k, not -|g * k|: k > 0, and the abs and negation are then free operand modifiers
        # of the FMUL; on the product they cost a LOP3 per element (the inline-asm ex2 takes none).
        e = exp2_fast(-tl.abs(g) * k, FAST)
        r = rcp_fast(1.0 + e, FAST)
        er = e * r
        s = tl.where(g >= 0, r, er)
        a = g * s
        # act' = s + g * s * (1 - s) * u'
        da = s + (g * du) * (er * r)
    return a, da


@triton.jit
def act_fwd(g, ACT: tl.constexpr, FAST: tl.constexpr):
    """act(g) alone, for the forward kernels (glu's and bias_gelu's).

    silu and tanh GELU take the plain g * sigmoid(u) = g / (1 + exp(-u)): exp overflowing to inf
    for g << 0 gives g * rcp(inf) = -0, the right limit, and the relative error stays a few ulp.
    act_and_grad's branch-free form (exp(-|u|) and a select, there to keep s * (1 - s) exact for
    the derivative) costs 3 more instructions per element (FSETP, FSEL, FMUL). The forward of
    bias_gelu is issue-bound too (4 bytes/element of traffic against ~31 instructions an SM can
    issue per element at the H200's copy bandwidth).
    """
    if ACT == 2:
        # (max(g, 0) - |g| * h, one FFMA instead of the select, compiles to the same 18 FP
        # instructions per element: ptxas already folds g * (1 - h) into an FFMA; sm_90a.)
        a, _ = act_and_grad(g, ACT, FAST)
        return a
    else:
        if ACT == 1:
            v = g * (_TANH_K1 + _TANH_K3 * (g * g))
        else:
            v = g * LOG2E
        return g * rcp_fast(1.0 + exp2_fast(-v, FAST), FAST)


@triton.jit
def _glu_fwd_kernel(
    g_ptr, u_ptr, y_ptr,
    n_rows, n_cols,
    stride_g, stride_u, stride_y,  # row strides, in elements; columns have stride 1
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    EVEN: tl.constexpr,  # every tile full (n_rows % BLOCK_M == 0, n_cols % BLOCK_N == 0): no masks
):  # fmt: skip
    # One row block per program, except past 65535 row blocks (CUDA's grid y limit): see `stream_tile`.
    for pid_m in range(tl.program_id(1), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(1)):
        rows, cols, mask = stream_tile(pid_m, n_rows, n_cols, BLOCK_M, BLOCK_N)
        r = rows[:, None]
        c = cols[None, :]
        # Upcast before any arithmetic (accuracy; and the interpreter gets bf16 arithmetic wrong).
        g = load_f32(g_ptr + r * stride_g + c, mask, EVEN, FAST)
        u = load_f32(u_ptr + r * stride_u + c, mask, EVEN, FAST)
        store_cast(y_ptr + r * stride_y + c, act_fwd(g, ACT, FAST) * u, mask, EVEN)


@triton.jit
def _glu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
    n_rows, n_cols,
    stride_dy, stride_g, stride_u, stride_dg, stride_du,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
    EVEN: tl.constexpr,  # every tile full (n_rows % BLOCK_M == 0, n_cols % BLOCK_N == 0): no masks
):  # fmt: skip
    for pid_m in range(tl.program_id(1), tl.cdiv(n_rows, BLOCK_M), tl.num_programs(1)):  # see _glu_fwd_kernel
        rows, cols, mask = stream_tile(pid_m, n_rows, n_cols, BLOCK_M, BLOCK_N)
        r = rows[:, None]
        c = cols[None, :]
        dy = load_f32(dy_ptr + r * stride_dy + c, mask, EVEN, FAST)
        g = load_f32(g_ptr + r * stride_g + c, mask, EVEN, FAST)
        u = load_f32(u_ptr + r * stride_u + c, mask, EVEN, FAST)
        # Recompute act(gate) rather than saving it: saves one tensor of memory and 2 bytes/elem
        # of traffic (write in forward, read in backward); the math is free in a streaming kernel.
        a, da = act_and_grad(g, ACT, FAST)
        store_cast(dg_ptr + r * stride_dg + c, dy * u * da, mask, EVEN)
        store_cast(du_ptr + r * stride_du + c, dy * a, mask, EVEN)


# --------------------------------------------------------------------------------------------
# 2. Launchers (tile shape and grid: `common.StreamConfig`, shared with bias_gelu)
# --------------------------------------------------------------------------------------------

# The GLU kernels' tile (elements per program; 4 warps below 4096): 1024 was the fastest of
# 1024-8192 on the H200 at 8192x11008 bf16 (SwiGLU fwd+bwd 332.5 us, torch.compile 332.7).
GLU_TILE = 1024


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise KprofError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise KprofError(
            f"{name} has dtype {t.dtype}; kprof's GLU kernels support float32, float16 and bfloat16 "
            f"(cast with .float() or .to(torch.bfloat16) first)"
        )
    if t.dim() == 0:
        raise KprofError(f"{name} is a 0-d tensor; expected shape [..., features]")


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    _check_dtype("gate", gate)
    _check_dtype("up", up)
    if gate.shape != up.shape:
        raise KprofError(
            f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)} "
            f"(no broadcasting; for one [..., 2*I] tensor use the *_packed functions)"
        )
    if gate.dtype != up.dtype:
        raise KprofError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise KprofError(f"gate and up must be on the same device, got {gate.device} and {up.device}")


def _check_packed(gu: torch.Tensor) -> None:
    _check_dtype("gu", gu)
    if gu.shape[-1] % 2:
        raise KprofError(
            f"gu's last dim must be even (gate half then up half), got shape {tuple(gu.shape)}"
        )


def _check_same(name: str, t: torch.Tensor, shape: torch.Size, like: torch.Tensor) -> None:
    if t.shape != shape or t.dtype != like.dtype or t.device != like.device:
        raise KprofError(
            f"{name} must have shape {tuple(shape)}, dtype {like.dtype} on {like.device}; "
            f"got {tuple(t.shape)}, {t.dtype} on {t.device}"
        )


def approx_act(approximate: str) -> int:
    if approximate not in GELU_ACT:
        raise KprofError(f"approximate must be 'tanh' or 'none' (as in F.gelu), got {approximate!r}")
    return GELU_ACT[approximate]


# The launchers below are the eager hot path (autograd.Functions call them directly; see
# `via_custom_op`), so they do no aten work beyond allocating outputs: contiguous tensors go to
# the kernel as they are, as one row of numel elements (no .view), and views are made only for
# strided inputs. On the H200 machine's host an aten op costs ~12 us and a launch ~24 us, which
# at 8192x11008 made fwd+bwd host-bound (638 us wall against 334 us of kernel time).


def _launch_fwd(g, u, y, n_rows: int, n_cols: int, sg: int, su: int, sy: int, act: int) -> None:
    """g, u, y: tensors (or views) addressed as (n_rows, n_cols) with unit column stride and
    row strides sg, su, sy."""
    grid, bm, bn, warps = stream_plan(n_rows, n_cols, GLU_TILE)
    with device_ctx(y):
        launch(_glu_fwd_kernel, grid,
            g, u, y, n_rows, n_cols, sg, su, sy,
            ACT=act, BLOCK_M=bm, BLOCK_N=bn, FAST=fast_math(y), EVEN=n_rows % bm == 0 and n_cols % bn == 0,
            num_warps=warps,
            **FP_FUSION,
        )  # fmt: skip


def _launch_bwd(dy, g, u, dg, du, n_rows: int, n_cols: int, strides: tuple, act: int) -> None:
    grid, bm, bn, warps = stream_plan(n_rows, n_cols, GLU_TILE)
    with device_ctx(dy):
        launch(_glu_bwd_kernel, grid,
            dy, g, u, dg, du, n_rows, n_cols, *strides,
            ACT=act, BLOCK_M=bm, BLOCK_N=bn, FAST=fast_math(dy), EVEN=n_rows % bm == 0 and n_cols % bn == 0,
            num_warps=warps,
            **FP_FUSION,
        )  # fmt: skip


def _glu_fwd(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    y = new_out(gate)
    numel = y.numel()
    if numel == 0:
        return y
    if gate.is_contiguous() and up.is_contiguous():
        # One long row: the kernel streams the flat buffers; no per-row tail blocks.
        _launch_fwd(gate, up, y, 1, numel, 0, 0, 0, act)
    else:
        n = gate.shape[-1]
        g2, u2 = as_rows(gate, n), as_rows(up, n)
        _launch_fwd(g2, u2, y, numel // n, n, g2.stride(0), u2.stride(0), n, act)
    return y


def _glu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int,
             in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up), new contiguous tensors; with in_place (callers check `_can_write_grads_into`)
    written over gate and up themselves: each program reads its tile of gate and up before it
    writes the same tile of the grads, so the overwrite is safe element by element."""
    if in_place:
        dg, du = gate, up
    else:
        dg, du = new_out(gate), new_out(gate)
    numel = dg.numel()
    if numel == 0:
        return dg, du
    if dy.is_contiguous() and gate.is_contiguous() and up.is_contiguous():
        _launch_bwd(dy, gate, up, dg, du, 1, numel, (0, 0, 0, 0, 0), act)
    else:
        n = gate.shape[-1]
        dy2, g2, u2 = as_rows(dy, n), as_rows(gate, n), as_rows(up, n)
        strides = (dy2.stride(0), g2.stride(0), u2.stride(0), n, n)
        _launch_bwd(dy2, g2, u2, dg, du, numel // n, n, strides, act)
    return dg, du


def _glu_packed_fwd(gu: torch.Tensor, act: int) -> torch.Tensor:
    i = gu.shape[-1] // 2
    y = torch.empty((*gu.shape[:-1], i), dtype=gu.dtype, device=gu.device)
    if y.numel() == 0:
        return y
    gu2 = as_rows(gu, 2 * i)  # (rows, 2I); the halves are views with row stride gu2.stride(0)
    s = gu2.stride(0)
    _launch_fwd(gu2[:, :i], gu2[:, i:], y, gu2.shape[0], i, s, s, i, act)
    return y


def _glu_packed_bwd(dy: torch.Tensor, gu: torch.Tensor, act: int) -> torch.Tensor:
    i = gu.shape[-1] // 2
    dgu = new_out(gu)
    if dgu.numel() == 0:
        return dgu
    gu2, dy2 = as_rows(gu, 2 * i), as_rows(dy, i)
    dgu2 = dgu.view(-1, 2 * i)
    s = gu2.stride(0)
    strides = (dy2.stride(0), s, s, 2 * i, 2 * i)
    _launch_bwd(dy2, gu2[:, :i], gu2[:, i:], dgu2[:, :i], dgu2[:, i:], gu2.shape[0], i, strides, act)
    return dgu


# Checked entry points (the custom ops call these; so can users): validate, then launch.


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """y = act(gate) * up, y contiguous in gate's shape and dtype."""
    _check_pair(gate, up)
    return _glu_fwd(gate, up, act)


def glu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up), both contiguous."""
    _check_pair(gate, up)
    _check_same("dy", dy, gate.shape, gate)
    return _glu_bwd(dy, gate, up, act)


def glu_packed_fwd(gu: torch.Tensor, act: int) -> torch.Tensor:
    """y = act(gu[..., :I]) * gu[..., I:], y of shape [..., I]."""
    _check_packed(gu)
    return _glu_packed_fwd(gu, act)


def glu_packed_bwd(dy: torch.Tensor, gu: torch.Tensor, act: int) -> torch.Tensor:
    """d_gu of gu's shape: d_gate in the first half, d_up in the second."""
    _check_packed(gu)
    _check_same("dy", dy, torch.Size((*gu.shape[:-1], gu.shape[-1] // 2)), gu)
    return _glu_packed_bwd(dy, gu, act)


# --------------------------------------------------------------------------------------------
# 3. torch.library custom ops (so torch.compile graphs keep the kernels with no graph break).
# The profiler recognizes `kprof::*` ops and costs them with `op_costs` below.
# --------------------------------------------------------------------------------------------


@kernel_op("kprof::swiglu_fwd")
def _swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return glu_fwd(gate, up, ACT_SILU)


@kernel_op("kprof::swiglu_bwd")
def _swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return glu_bwd(dy, gate, up, ACT_SILU)


@kernel_op("kprof::geglu_fwd")
def _geglu_fwd_op(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    return glu_fwd(gate, up, approx_act(approximate))


@kernel_op("kprof::geglu_bwd")
def _geglu_bwd_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return glu_bwd(dy, gate, up, approx_act(approximate))


@kernel_op("kprof::swiglu_packed_fwd")
def _swiglu_packed_fwd_op(gu: torch.Tensor) -> torch.Tensor:
    return glu_packed_fwd(gu, ACT_SILU)


@kernel_op("kprof::swiglu_packed_bwd")
def _swiglu_packed_bwd_op(dy: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    return glu_packed_bwd(dy, gu, ACT_SILU)


@kernel_op("kprof::geglu_packed_fwd")
def _geglu_packed_fwd_op(gu: torch.Tensor, approximate: str) -> torch.Tensor:
    return glu_packed_fwd(gu, approx_act(approximate))


@kernel_op("kprof::geglu_packed_bwd")
def _geglu_packed_bwd_op(dy: torch.Tensor, gu: torch.Tensor, approximate: str) -> torch.Tensor:
    return glu_packed_bwd(dy, gu, approx_act(approximate))


# Fakes: outputs are freshly allocated and contiguous, like the launchers'.
def _fake_pair_fwd(gate, up, *_):
    return gate.new_empty(gate.shape)


def _fake_pair_bwd(dy, gate, up, *_):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _fake_packed_fwd(gu, *_):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


def _fake_packed_bwd(dy, gu, *_):
    return gu.new_empty(gu.shape)


for _op, _fake in (
    (_swiglu_fwd_op, _fake_pair_fwd),
    (_geglu_fwd_op, _fake_pair_fwd),
    (_swiglu_bwd_op, _fake_pair_bwd),
    (_geglu_bwd_op, _fake_pair_bwd),
    (_swiglu_packed_fwd_op, _fake_packed_fwd),
    (_geglu_packed_fwd_op, _fake_packed_fwd),
    (_swiglu_packed_bwd_op, _fake_packed_bwd),
    (_geglu_packed_bwd_op, _fake_packed_bwd),
):
    _op.register_fake(_fake)


# In-place backward (`grad_in_place=True`): d_gate and d_up written over the saved gate and up.
# Why: on the 1B Llama step (H200, benchmarks/memory_peak.py) kprof's peak came in
# the last MLP's backward, where the new d_gate and d_up (2 x 128 MiB at 8192 tokens x 8192)
# were alive next to every layer's saved activations: 5.44 GiB above the parameters against
# Liger's 5.31 (Liger's SwiGLU backward writes its grads over its inputs, as this does).
# Only the gated-MLP patch asks for it: there gate and up are temporaries of its own forward.
# The saved tensors' version counters are bumped, so a second backward through the same graph
# (retain_graph=True) fails with PyTorch's "modified by an inplace operation" error instead of
# reading grads as activations.


def _can_write_grads_into(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Both contiguous and not overlapping each other (the packed layout's halves, a view of one
    buffer, never qualify: they are not contiguous)."""
    if not (gate.is_contiguous() and up.is_contiguous()) or gate.numel() == 0:
        return False
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return True
    a, b = gate.data_ptr(), up.data_ptr()
    return abs(a - b) >= gate.numel() * gate.element_size()


@kernel_op("kprof::swiglu_bwd_inplace", mutates_args=("gate", "up"))
def _swiglu_bwd_inplace_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    _glu_bwd(dy, gate, up, ACT_SILU, in_place=True)


@kernel_op("kprof::geglu_bwd_inplace", mutates_args=("gate", "up"))
def _geglu_bwd_inplace_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    _glu_bwd(dy, gate, up, approx_act(approximate), in_place=True)


def _pair_backward(ctx, dy: torch.Tensor, act: int, out_of_place_op, in_place_op, *extra):
    """The pair Functions' backward: in place when the forward asked for it and it is safe
    (eager, or recorded by a profiler through the mutating op; never while compiling, where the
    out-of-place op keeps the graph functional)."""
    gate, up = ctx.saved_tensors
    if ctx.grad_in_place and not torch.compiler.is_compiling() and _can_write_grads_into(gate, up):
        if via_custom_op():
            in_place_op(dy, gate, up, *extra)
        else:
            _glu_bwd(dy, gate, up, act, in_place=True)
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        return gate.detach(), up.detach()
    if via_custom_op():
        return out_of_place_op(dy, gate, up, *extra)
    return _glu_bwd(dy, gate, up, act)


# --------------------------------------------------------------------------------------------
# 4. autograd.Functions
# --------------------------------------------------------------------------------------------


# Inputs were validated by the public function and autograd hands backward a dy of y's shape,
# dtype and device, so the eager path calls the unchecked launchers; under torch.compile or a
# recording profiler (`via_custom_op`) it goes through the custom ops instead (an opaque node for
# the compiler; `kprof::*` ops with input shapes in the trace for the cost model).


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, grad_in_place):
        ctx.save_for_backward(gate, up)
        ctx.grad_in_place = grad_in_place
        if via_custom_op():
            return _swiglu_fwd_op(gate, up)
        return _glu_fwd(gate, up, ACT_SILU)

    @staticmethod
    def backward(ctx, dy):
        return (*_pair_backward(ctx, dy, ACT_SILU, _swiglu_bwd_op, _swiglu_bwd_inplace_op), None)


class _GeGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, approximate, grad_in_place):
        ctx.save_for_backward(gate, up)
        ctx.approximate, ctx.grad_in_place = approximate, grad_in_place
        if via_custom_op():
            return _geglu_fwd_op(gate, up, approximate)
        return _glu_fwd(gate, up, GELU_ACT[approximate])

    @staticmethod
    def backward(ctx, dy):
        act = GELU_ACT[ctx.approximate]
        dg, du = _pair_backward(ctx, dy, act, _geglu_bwd_op, _geglu_bwd_inplace_op, ctx.approximate)
        return dg, du, None, None


class _SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        ctx.save_for_backward(gu)
        if via_custom_op():
            return _swiglu_packed_fwd_op(gu)
        return _glu_packed_fwd(gu, ACT_SILU)

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        if via_custom_op():
            return _swiglu_packed_bwd_op(dy, gu)
        return _glu_packed_bwd(dy, gu, ACT_SILU)


class _GeGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, approximate):
        ctx.save_for_backward(gu)
        ctx.approximate = approximate
        if via_custom_op():
            return _geglu_packed_fwd_op(gu, approximate)
        return _glu_packed_fwd(gu, GELU_ACT[approximate])

    @staticmethod
    def backward(ctx, dy):
        (gu,) = ctx.saved_tensors
        if via_custom_op():
            return _geglu_packed_bwd_op(dy, gu, ctx.approximate), None
        return _glu_packed_bwd(dy, gu, GELU_ACT[ctx.approximate]), None


# --------------------------------------------------------------------------------------------
# 5. Public functions
# --------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, grad_in_place: bool = False) -> torch.Tensor:
    """`F.silu(gate) * up`, fused; differentiable in gate and up.

    gate, up: same shape [..., I], same dtype (float32, float16, bfloat16), same device; any
    strides. Returns a contiguous tensor of that shape and dtype. Matches HF LlamaMLP's
    `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU: computed in fp32 and rounded once
    (eager bf16 rounds twice, so results differ from eager by at most about one bf16 ulp).
    Backward recomputes silu(gate) and returns (d_gate, d_up).

    grad_in_place: the backward writes d_gate and d_up over gate and up (when both are
    contiguous and apart; not under torch.compile), saving two gate-sized buffers at the
    backward's memory peak. Only for gate and up that nothing else reads after this call (as in
    `down(swiglu(gate_proj(x), up_proj(x)))`): their contents become the grads. A second backward
    through the same graph raises PyTorch's in-place modification error.
    """
    _check_pair(gate, up)
    if use_triton(gate):
        return _SwiGLUFunction.apply(gate, up, grad_in_place)
    warn_fallback("glu", f"no Triton backend for {gate.device.type} tensors")
    return swiglu_reference(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *,
          grad_in_place: bool = False) -> torch.Tensor:
    """`F.gelu(gate, approximate=approximate) * up`, fused; differentiable in gate and up.

    approximate: "tanh" (default: Gemma's gelu_pytorch_tanh, GPT-2's gelu_new) or "none" (erf).
    Shapes, dtypes, numerics and `grad_in_place` as `swiglu`.
    """
    _check_pair(gate, up)
    approx_act(approximate)
    if use_triton(gate):
        return _GeGLUFunction.apply(gate, up, approximate, grad_in_place)
    warn_fallback("glu", f"no Triton backend for {gate.device.type} tensors")
    return geglu_reference(gate, up, approximate)


def swiglu_packed(gu: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` with gate, up = gu.chunk(2, dim=-1): GATE FIRST, UP SECOND.

    gu: [..., 2*I] (last dim even), float32/float16/bfloat16, any strides. Returns [..., I].
    The backward returns one d_gu in the same [d_gate | d_up] layout, so a fused gate_up
    projection (Phi-3's gate_up_proj) gets its gradient without a cat.
    """
    _check_packed(gu)
    if use_triton(gu):
        return _SwiGLUPackedFunction.apply(gu)
    warn_fallback("glu", f"no Triton backend for {gu.device.type} tensors")
    return swiglu_packed_reference(gu)


def geglu_packed(gu: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """`F.gelu(gate, approximate=approximate) * up` with gate, up = gu.chunk(2, dim=-1)
    (gate first). As `swiglu_packed`, with `approximate` as in `geglu`."""
    _check_packed(gu)
    approx_act(approximate)
    if use_triton(gu):
        return _GeGLUPackedFunction.apply(gu, approximate)
    warn_fallback("glu", f"no Triton backend for {gu.device.type} tensors")
    return geglu_packed_reference(gu, approximate)


# --------------------------------------------------------------------------------------------
# 6. References: the eager formulation, in the input dtype (what users run today).
# Tests call them on inputs upcast to fp32/fp64 for a high-precision reference.
# --------------------------------------------------------------------------------------------


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up


def swiglu_packed_reference(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu_packed_reference(gu: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


# --------------------------------------------------------------------------------------------
# 7. Registry: cost models (bytes: each input read once, each output written once).
# FLOPs per element counted from the kernels' fp32 ops, one per add/mul/div/compare and one
# per transcendental (exp, erf):
#   silu fwd: sigmoid (neg, exp, add, div = 4) + g*s + *up = 6
#   gelu tanh fwd: g^3 (2) + fma-shaped poly (2) + scale (1) + sigmoid (4) + g*s + *up = 11
#   gelu erf fwd: scale, erf, +1, *0.5, *g, *up = 6
#   backward: the forward's activation plus its derivative and the two products:
#   silu 6 + (1-s, g*s, *(1-s), +s, dy*u, *da, dy*a) 7 = 13; gelu tanh 11 + 3 (du) + 7 = 21;
#   gelu erf 6 + (g*g, *-0.5, exp, *c, *g, +cdf) 6 + (dy*u, *da, dy*a) 3 = 15.
# --------------------------------------------------------------------------------------------

_FLOPS_PER_ELEM = {  # (fwd, bwd)
    ACT_SILU: (6, 13),
    ACT_GELU_TANH: (11, 21),
    ACT_GELU_ERF: (6, 15),
}


def _glu_cost(n_elems: int, dtype: torch.dtype, act: int) -> dict[str, Cost]:
    """n_elems = elements of gate (= of up = of y)."""
    b = dtype.itemsize
    f_fwd, f_bwd = _FLOPS_PER_ELEM[act]
    return {
        "fwd": Cost(flops=f_fwd * n_elems, bytes=3 * b * n_elems),  # read gate, up; write y
        "bwd": Cost(flops=f_bwd * n_elems, bytes=5 * b * n_elems),  # read dy, gate, up; write dg, du
    }


def _make_spec(name: str, act: int, packed: bool) -> KernelSpec:
    def cost(n_rows: int, n_cols: int, dtype: torch.dtype = torch.bfloat16, approximate: str = "tanh") -> dict[str, Cost]:
        """n_rows x n_cols = shape of gate (= of up = of the output; I = n_cols)."""
        a = act if name.startswith("swiglu") else approx_act(approximate)
        return _glu_cost(n_rows * n_cols, dtype, a)

    def elems(meta: TensorMeta) -> int:  # gate-sized elements from the op's first tensor input
        return numel(meta.shape) // (2 if packed else 1)

    fwd_op, bwd_op = f"kprof::{name}_fwd", f"kprof::{name}_bwd"
    # Per-op costs see only tensor metas, not `approximate`: geglu ops are costed as tanh (the
    # default and the larger FLOP count); bytes are exact either way.
    op_act = act
    op_costs = {
        fwd_op: lambda metas: _glu_cost(elems(metas[0]), metas[0].dtype, op_act)["fwd"],
        # bwd inputs: (dy, gate, up) or (dy, gu); dy is gate-sized in both layouts
        bwd_op: lambda metas: _glu_cost(numel(metas[0].shape), metas[0].dtype, op_act)["bwd"],
    }
    if not packed:  # the in-place backward moves the same bytes (writes over its inputs)
        op_costs[bwd_op + "_inplace"] = op_costs[bwd_op]
    fns = {
        "swiglu": (swiglu, swiglu_reference, "F.silu(gate) * up (HF LlamaMLP act_fn(gate_proj(x)) * up_proj(x))"),
        "geglu": (geglu, geglu_reference, "F.gelu(gate, approximate) * up (HF GemmaMLP)"),
        "swiglu_packed": (swiglu_packed, swiglu_packed_reference, "g, u = gu.chunk(2, -1); F.silu(g) * u"),
        "geglu_packed": (geglu_packed, geglu_packed_reference, "g, u = gu.chunk(2, -1); F.gelu(g, approximate) * u"),
    }
    fn, ref, replaces = fns[name]
    return KernelSpec(
        name=name,
        replaces=replaces,
        dtypes=SUPPORTED_DTYPES,
        limits="any shape and strides (non-unit last-dim strides are copied first); rows of any "
        "length are split into column blocks",
        deterministic=True,  # elementwise: no reductions, no atomics
        fn=fn,
        module=None,
        reference=ref,
        cost=cost,
        op_costs=op_costs,
    )


SWIGLU_SPEC = register(_make_spec("swiglu", ACT_SILU, packed=False))
GEGLU_SPEC = register(_make_spec("geglu", ACT_GELU_TANH, packed=False))
SWIGLU_PACKED_SPEC = register(_make_spec("swiglu_packed", ACT_SILU, packed=True))
GEGLU_PACKED_SPEC = register(_make_spec("geglu_packed", ACT_GELU_TANH, packed=True))

"""Fused rotary position embedding for q and k in one launch: Hugging Face's rotate-half
convention or torchtitan's interleaved (complex) one, over the whole head dim or, as GPT-NeoX and
Phi do (partial rotary), over its first rot_dim.

Eager code (transformers' `apply_rotary_pos_emb`):

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)              # [B, 1, S, D]
    q_embed = q * cos + rotate_half(q) * sin                    # rotate_half: cat(-x2, x1)
    k_embed = k * cos + rotate_half(k) * sin

is ~10 elementwise kernels (two slices, neg, cat, two muls, add; per tensor) and as many
round trips of q and k through memory. Here one program per (batch, position) loads that
position's cos/sin row once and rotates all q heads and all k heads with it:

    out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h]
    out[h:] = x[h:] * cos[h:] + x[:h] * sin[h:]          (h = D / 2)

Partial rotary (cos/sin [B, S, R] with R < D, R even; transformers' GPT-NeoX code slices
q[..., :R], rotates it and cats q[..., R:] back, 4 more ops per tensor): the same program rotates
the first R of each head with h = R / 2 and copies the other D - R through (PASS); the backward
copies those grads the same way (the pass-through's Jacobian is the identity):

    D = 32, R = 8:   | x[0:4] x[4:8] | x[8:32]  |
                     |  rotated, h=4 | copied   |

Interleaved (INTERLEAVED; torchtitan's and Meta's Llama `view_as_complex(x.reshape(..., -1, 2))
* freqs_cis`): pair i is (2i, 2i + 1) instead of (i, i + h), with cos/sin given per element in
that layout (each pair's value twice), so the same formula and its backward hold with cos/sin
read at x's offsets:

    rotate-half, D = 8:   (x0, x4) (x1, x5) (x2, x6) (x3, x7)
    interleaved, D = 8:   (x0, x1) (x2, x3) (x4, x5) (x6, x7)

The interleaved pairs are stride-2 accesses (not 16-byte vectors on the GPU; not yet measured).

Why: with q and k both [8, 32, 2048, 128] bf16 (134 MB each), each direction must move 537 MB
(read q, k, write both: 126 us at the H200's 4.27 TB/s), and cos and sin ([B, S, D], 4 MB each
here) are read once per position, not once per head. A design that looped the heads of q then
of k, one half-tile pair in flight, measured ~160 us per direction on the H200; `RopeConfig`
therefore loads all four half-tiles of a position before storing any (ONE_TILE).

Layouts: q/k are addressed through their strides, so the usual non-contiguous inputs - a
`[B, S, H, D]` projection view transposed to `[B, H, S, D]`, or a slice of a fused qkv
projection - are read in place, without a copy. Outputs are allocated with `torch.empty_like(q)`,
i.e. in the same memory layout as q when q is dense (as eager's elementwise ops do), and the
backward writes dq, dk in that same layout (so the transpose/view backward of HF's projection
views needs no copy). Only a last-dim stride != 1 forces a copy (and a contiguous output).

Host work per eager call (the H200 machine's eager path is host-bound, see
kernels/common.py::via_custom_op): two output allocations and one launch per direction; no
view, expand or contiguous ops (tests/kernels/test_rope.py::test_eager_path_launches_directly).
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
from kprof.kernels.common import FP_FUSION, kernel_op, launch, next_power_of_2, num_warps, use_triton, via_custom_op, warn_fallback
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# 1. Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate(x1, x2, cos1, cos2, sin1, sin2):
    """out[:h] = x[:h] cos[:h] - x[h:] sin[:h], out[h:] = x[h:] cos[h:] + x[:h] sin[h:] (fp32)."""
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, x_head_stride, o_head_stride, n_heads, step, e, d_ok,
    cos1, cos2, sin1, sin2, BLOCK_H: tl.constexpr,
):
    """Rotate every head of one (batch, position) for one block of pairs (e, e + step), `e`
    [1, BLOCK_D]; x_ptr and o_ptr point at head 0 of that position."""
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        ok = (h < n_heads) & d_ok
        xp = x_ptr + h * x_head_stride + e
        op = o_ptr + h * o_head_stride + e
        x1 = tl.load(xp, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(xp + step, mask=ok, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, cos1, cos2, sin1, sin2)
        tl.store(op, o1.to(o_ptr.dtype.element_ty), mask=ok)
        tl.store(op + step, o2.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _copy_heads(
    x_ptr, o_ptr, x_head_stride, o_head_stride, n_heads, start, stop,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """o[h, start:stop] = x[h, start:stop] for every head of one (batch, position): the part of a
    partial rotary embedding that is not rotated (forward and backward alike)."""
    for d0 in range(start, stop, BLOCK_P):
        d = d0 + tl.arange(0, BLOCK_P)[None, :]  # [1, BLOCK_P]
        d_ok = d < stop
        for h0 in range(0, n_heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)[:, None]
            ok = (h < n_heads) & d_ok
            x = tl.load(x_ptr + h * x_head_stride + d, mask=ok, other=0.0)
            tl.store(o_ptr + h * o_head_stride + d, x.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    seq_len, n_q_heads, n_k_heads, half, head_dim,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss,
    qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss,
    c_sb, c_ss,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_TILE: tl.constexpr, BACKWARD: tl.constexpr, PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """One program per (batch, position): all q heads and all k heads, strides [B, H, S, D]
    with unit last-dim stride. cos/sin are [B, S, 2 * half] (stride 0 where broadcast); with PASS
    (2 * half < head_dim) the last head_dim - 2 * half elements of each head are copied through.
    Pair i is (i, i + half), or (2i, 2i + 1) with INTERLEAVED (cos/sin then hold each pair's value
    twice, so they are read at x's offsets).

    ONE_TILE (every head of q and of k and the whole half dim fit one [BLOCK_H, BLOCK_D] tile
    each, e.g. Llama's 32 x 64): the four input tiles q[:h], q[h:], k[:h], k[h:] are all loaded
    before anything is stored, so a program has all its bytes in flight at once (16 KB at 32+32
    heads x 128 bf16). Otherwise heads and the half dim are looped in blocks, q then k.
    """
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    c_base = b * c_sb + s * c_ss
    q_ptr += b * q_sb + s * q_ss
    k_ptr += b * k_sb + s * k_ss
    qo_ptr += b * qo_sb + s * qo_ss
    ko_ptr += b * ko_sb + s * ko_ss
    for d0 in range(0, half, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        d_ok = d < half
        if INTERLEAVED:  # pair (2i, 2i + 1): torchtitan's complex form
            e = 2 * d
            step = 1
        else:  # pair (i, i + half)
            e = d
            step = half
        cos1 = tl.load(cos_ptr + c_base + e, mask=d_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + c_base + e + step, mask=d_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + c_base + e, mask=d_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + c_base + e + step, mask=d_ok, other=0.0).to(tl.float32)
        if BACKWARD:
            # The forward is linear in x with matrix [[C1, -S1], [S2, C2]] (per d); its transpose
            # [[C1, S2], [-S1, C2]] is the forward's form with (sin1, sin2) -> (-sin2, -sin1).
            # With HF's cos/sin (both halves equal) that is "rotate by -sin".
            neg_sin2 = -sin2
            sin2 = -sin1
            sin1 = neg_sin2
        if ONE_TILE:
            hq = tl.arange(0, BLOCK_HQ)[:, None]
            hk = tl.arange(0, BLOCK_HK)[:, None]
            q_ok = (hq < n_q_heads) & d_ok
            k_ok = (hk < n_k_heads) & d_ok
            qp = q_ptr + hq * q_sh + e
            kp = k_ptr + hk * k_sh + e
            q1 = tl.load(qp, mask=q_ok, other=0.0).to(tl.float32)
            q2 = tl.load(qp + step, mask=q_ok, other=0.0).to(tl.float32)
            k1 = tl.load(kp, mask=k_ok, other=0.0).to(tl.float32)
            k2 = tl.load(kp + step, mask=k_ok, other=0.0).to(tl.float32)
            qo1, qo2 = _rotate(q1, q2, cos1, cos2, sin1, sin2)
            ko1, ko2 = _rotate(k1, k2, cos1, cos2, sin1, sin2)
            qop = qo_ptr + hq * qo_sh + e
            kop = ko_ptr + hk * ko_sh + e
            tl.store(qop, qo1.to(qo_ptr.dtype.element_ty), mask=q_ok)
            tl.store(qop + step, qo2.to(qo_ptr.dtype.element_ty), mask=q_ok)
            tl.store(kop, ko1.to(ko_ptr.dtype.element_ty), mask=k_ok)
            tl.store(kop + step, ko2.to(ko_ptr.dtype.element_ty), mask=k_ok)
        else:
            _rotate_heads(q_ptr, qo_ptr, q_sh, qo_sh, n_q_heads, step, e, d_ok, cos1, cos2, sin1, sin2, BLOCK_HQ)
            _rotate_heads(k_ptr, ko_ptr, k_sh, ko_sh, n_k_heads, step, e, d_ok, cos1, cos2, sin1, sin2, BLOCK_HK)
    if PASS:
        _copy_heads(q_ptr, qo_ptr, q_sh, qo_sh, n_q_heads, 2 * half, head_dim, BLOCK_HQ, BLOCK_P)
        _copy_heads(k_ptr, ko_ptr, k_sh, ko_sh, n_k_heads, 2 * half, head_dim, BLOCK_HK, BLOCK_P)


# ---------------------------------------------------------------------------------------------
# 2. Host launchers
# ---------------------------------------------------------------------------------------------

# Half-dims wider than this loop inside the program (head_dim 128 -> one 64-wide block; only
# exotic head dims > 256 loop). Keeps the tile bounded for any head_dim.
MAX_BLOCK_D = 128
# Largest q+k tile (elements of all four half-tiles) taken in one piece (ONE_TILE): 32+32 heads
# x 128 is 8192; 64+8 heads (Llama-70B) 9216; up to 128+128 heads x 64. Bigger head counts
# loop over head blocks of LOOP_TILE_ELEMS // BLOCK_D rows.
MAX_ONE_TILE_ELEMS = 16384
LOOP_TILE_ELEMS = 2048


@dataclass(frozen=True)
class RopeConfig:
    """Launch parameters, from the tile budget above. ONE_TILE puts all four half-tiles in
    flight at 4-8 warps: 2048 elements per warp (16 fp32 values per thread per tile; not yet
    measured on the H200, see docs/kernels.md)."""

    block_hq: int
    block_hk: int
    block_d: int
    one_tile: bool
    num_warps: int
    # Width of the pass-through copy's blocks (partial rotary); its tiles are [BLOCK_H, block_p].
    block_p: int = 16

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(n_q_heads: int, n_k_heads: int, half: int, n_pass: int = 0) -> "RopeConfig":
        # Cached on ints: built once per shape, not per call (the eager path is host-bound).
        block_d = min(next_power_of_2(max(half, 1)), MAX_BLOCK_D)
        bhq, bhk = next_power_of_2(max(n_q_heads, 1)), next_power_of_2(max(n_k_heads, 1))
        elems = 2 * (bhq + bhk) * block_d
        if half <= block_d and elems <= MAX_ONE_TILE_ELEMS:
            bh_q, bh_k, one_tile, warps = bhq, bhk, True, num_warps(elems, per_thread=64, max_warps=8)
        else:
            bh = max(1, LOOP_TILE_ELEMS // block_d)
            bh_q, bh_k, one_tile, warps = min(bhq, bh), min(bhk, bh), False, 4
        # Copy tiles as wide as a half-tile pair (2 * block_d), or LOOP_TILE_ELEMS over the heads
        # for narrow rotations: GPT-NeoX's R = 32 of D = 128 at 32 heads copies 96 a head in 64s.
        block_p = min(next_power_of_2(max(n_pass, 1)), max(2 * block_d, LOOP_TILE_ELEMS // max(bh_q, bh_k)))
        return RopeConfig(bh_q, bh_k, block_d, one_tile, warps, block_p)


def _dense_unit_last(shape, stride) -> bool:
    """Whether (shape, stride) is a permutation of a contiguous layout with unit last-dim stride
    (what empty_like reproduces), from Python ints alone."""
    if len(shape) and shape[-1] > 1 and stride[-1] != 1:
        return False
    expected = 1
    for size, st in sorted(zip(shape, stride), key=lambda p: p[1]):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def _out_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Output in t's memory layout when t is dense with unit last-dim stride (as eager's
    elementwise ops do), else contiguous: the kernel writes with unit last-dim stride."""
    if t.is_contiguous() or _dense_unit_last(t.shape, t.stride()):
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _bhs_strides(stride: tuple[int, ...], unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, head, seq) strides of q/k/outputs read as [B, H, S, D], without a transpose view."""
    return (stride[0], stride[1], stride[2]) if unsqueeze_dim == 1 else (stride[0], stride[2], stride[1])


def _cos_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int]:
    """(batch, seq) strides of cos/sin as [B, S, D], 0 where broadcast; 2-D [S, D] is [1, S, D]."""
    if len(shape) == 3:
        return (stride[0] if shape[0] != 1 else 0), (stride[1] if shape[1] != 1 else 0)
    return 0, (stride[0] if shape[0] != 1 else 0)


@functools.lru_cache(maxsize=1024)
def _rope_plan(q_shape, q_stride, k_shape, k_stride, qo_stride, ko_stride, c_shape, c_stride, s_shape, s_stride,
               unsqueeze_dim: int):
    """(grid, the kernel's int arguments, RopeConfig.for_shape's arguments) of a launch on
    tensors of these shapes and strides, or None when q, k, cos or sin needs a copy first (a
    last dim of non-unit stride; cos and sin strided differently). Cached on the shapes and
    strides: read from the tensors per call it was ~22 stride calls and ~10 us of the fwd+bwd's
    Python on the dev CPU (benchmarks/host_cost_cpu.py)."""
    if any(shape[-1] > 1 and stride[-1] != 1 for shape, stride in
           ((q_shape, q_stride), (k_shape, k_stride), (c_shape, c_stride), (s_shape, s_stride))):
        return None
    c_strides = _cos_strides(c_shape, c_stride)
    if c_strides != _cos_strides(s_shape, s_stride):  # one set of strides for both tables
        return None
    s_dim = 2 if unsqueeze_dim == 1 else 1
    batch, seq, head_dim = q_shape[0], q_shape[s_dim], q_shape[3]
    n_q_heads, n_k_heads = q_shape[3 - s_dim], k_shape[3 - s_dim]
    half = c_shape[-1] // 2  # rot_dim / 2: head_dim / 2 unless partial
    ints = (seq, n_q_heads, n_k_heads, half, head_dim,
            *_bhs_strides(q_stride, unsqueeze_dim), *_bhs_strides(k_stride, unsqueeze_dim),
            *_bhs_strides(qo_stride, unsqueeze_dim), *_bhs_strides(ko_stride, unsqueeze_dim), *c_strides)
    return (batch * seq,), ints, (n_q_heads, n_k_heads, half, head_dim - 2 * half)


def _plan_of(q, k, cos, sin, unsqueeze_dim, qo, ko):
    return _rope_plan(q.shape, q.stride(), k.shape, k.stride(), qo.stride(), ko.stride(),
                      cos.shape, cos.stride(), sin.shape, sin.stride(), unsqueeze_dim)


def _rope_launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
    qo: torch.Tensor, ko: torch.Tensor, backward: bool, config: Optional[RopeConfig] = None,
    interleaved: bool = False,
) -> None:
    """Rotate q, k into the preallocated qo, ko (any dense layout with unit last-dim stride).

    `config` overrides the launch parameters (benchmarks/cases/softmax_rope.py sweeps them).
    Host work for the usual inputs is the launch alone: strides are read from the tensors as
    they are (no transpose, expand or contiguous views; each aten op costs ~12 us of host time
    and the launch ~24 us on the H200 machine, where eager RoPE was host-bound).
    """
    if qo.numel() == 0 and ko.numel() == 0:
        return
    plan = _plan_of(q, k, cos, sin, unsqueeze_dim, qo, ko)
    if plan is None:
        q, k = _unit_last(q), _unit_last(k)
        cos, sin = _unit_last(cos), _unit_last(sin)
        plan = _plan_of(q, k, cos, sin, unsqueeze_dim, qo, ko)
        if plan is None:  # cos and sin strided differently
            cos, sin = cos.contiguous(), sin.contiguous()
            plan = _plan_of(q, k, cos, sin, unsqueeze_dim, qo, ko)
    grid, ints, dims = plan
    n_pass = dims[3]
    cfg = config or RopeConfig.for_shape(*dims)
    launch(_rope_kernel, grid,
        q, k, qo, ko, cos, sin, *ints,
        BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk, BLOCK_D=cfg.block_d, ONE_TILE=cfg.one_tile,
        BACKWARD=backward, PASS=n_pass > 0, BLOCK_P=cfg.block_p, INTERLEAVED=interleaved, num_warps=cfg.num_warps,
        **FP_FUSION,
    )


def _out_dtype(q: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    return q.dtype if cos.dtype == q.dtype else torch.promote_types(q.dtype, cos.dtype)


def _rope_fwd(q, k, cos, sin, unsqueeze_dim, interleaved=False):
    out_dtype = _out_dtype(q, cos)
    qo, ko = _out_like(q, out_dtype), _out_like(k, out_dtype)
    _rope_launch(q, k, cos, sin, unsqueeze_dim, qo, ko, backward=False, interleaved=interleaved)
    return qo, ko


# ---------------------------------------------------------------------------------------------
# 3. torch.library custom ops
# ---------------------------------------------------------------------------------------------


@kernel_op("kprof::rope_fwd")
def rope_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_fwd(q, k, cos, sin, unsqueeze_dim, interleaved)


@rope_fwd_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim, interleaved=False):
    out_dtype = _out_dtype(q, cos)
    return _out_like(q, out_dtype), _out_like(k, out_dtype)


@kernel_op("kprof::rope_bwd")
def rope_bwd_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    dq_in, dk_in = _out_like(dq, dq.dtype), _out_like(dk, dk.dtype)
    _rope_launch(dq, dk, cos, sin, unsqueeze_dim, dq_in, dk_in, backward=True, interleaved=interleaved)
    return dq_in, dk_in


@rope_bwd_op.register_fake
def _(dq, dk, cos, sin, unsqueeze_dim, interleaved=False):
    return _out_like(dq, dq.dtype), _out_like(dk, dk.dtype)


# ---------------------------------------------------------------------------------------------
# 4. autograd
# ---------------------------------------------------------------------------------------------


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved):
        if via_custom_op():  # compile or profiler: one opaque kprof:: op (see via_custom_op)
            q_embed, k_embed = rope_fwd_op(q, k, cos, sin, unsqueeze_dim, interleaved)
        else:
            q_embed, k_embed = _rope_fwd(q, k, cos, sin, unsqueeze_dim, interleaved)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved
        ctx.in_dtype = q.dtype
        # The grads go out in the layout of q_embed/k_embed, i.e. q's and k's when those are
        # dense (a transposed [B, S, H, D] projection view stays one): the transpose/view
        # backward upstream then needs no copy, and AccumulateGrad on such a leaf no re-stride.
        ctx.layouts = (q_embed.shape, q_embed.stride(), k_embed.shape, k_embed.stride())
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        if via_custom_op():
            dq, dk = rope_bwd_op(dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim, ctx.interleaved)
            if dq.dtype != ctx.in_dtype:  # only when cos/sin promoted the output (e.g. fp32 cos, bf16 q)
                dq, dk = dq.to(ctx.in_dtype), dk.to(ctx.in_dtype)
        else:
            q_shape, q_stride, k_shape, k_stride = ctx.layouts
            dev = dq_embed.device
            dq = torch.empty_strided(q_shape, q_stride, dtype=ctx.in_dtype, device=dev)
            dk = torch.empty_strided(k_shape, k_stride, dtype=ctx.in_dtype, device=dev)
            _rope_launch(dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim, dq, dk, backward=True,
                         interleaved=ctx.interleaved)
        # No grads for cos/sin: HF builds them from a buffer under no_grad.
        return dq, dk, None, None, None, None


# ---------------------------------------------------------------------------------------------
# 5. Public function
# ---------------------------------------------------------------------------------------------


def _normalize(q, k, cos, sin, position_ids, unsqueeze_dim, dtypes=DTYPES) -> int:
    """Validate the arguments; return unsqueeze_dim as 1 or 2."""
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        # transformers >= 5 dropped position_ids: apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim).
        unsqueeze_dim = position_ids
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise KprofError(f"apply_rope: {name} must be 4-D [B, H, S, D] (or [B, S, H, D] with unsqueeze_dim=2); "
                             f"got shape {tuple(t.shape)}")
    if unsqueeze_dim < 0:
        unsqueeze_dim += 4  # cos [B, S, D].unsqueeze(-3) == unsqueeze(1), unsqueeze(-2) == unsqueeze(2)
    if unsqueeze_dim not in (1, 2):
        raise KprofError(f"apply_rope: unsqueeze_dim must be 1 (q/k [B, H, S, D]) or 2 (q/k [B, S, H, D]); "
                         f"got {unsqueeze_dim}")
    if q.dtype not in dtypes or k.dtype != q.dtype:
        raise KprofError(f"apply_rope: q and k must share one dtype of float32/float16/bfloat16; "
                         f"got q {q.dtype}, k {k.dtype}")
    if cos.dtype not in dtypes or sin.dtype != cos.dtype:
        raise KprofError(f"apply_rope: cos and sin must share one dtype of float32/float16/bfloat16; "
                         f"got cos {cos.dtype}, sin {sin.dtype}")
    if not q.device == k.device == cos.device == sin.device:  # the set only for the message: ~2 us a call
        devices = {t.device for t in (q, k, cos, sin)}
        raise KprofError(f"apply_rope: q, k, cos, sin must be on one device; got {sorted(map(str, devices))}")
    s_dim = 2 if unsqueeze_dim == 1 else 1
    b, seq, d = q.shape[0], q.shape[s_dim], q.shape[-1]
    if k.shape[0] != b or k.shape[s_dim] != seq or k.shape[-1] != d:
        raise KprofError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim "
                         f"(unsqueeze_dim={unsqueeze_dim})")
    if d % 2:
        raise KprofError(f"apply_rope: head_dim must be even for rotate-half RoPE; got {d}")
    if cos.shape != sin.shape:
        raise KprofError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    c = cos.shape if cos.dim() == 3 else (1, *cos.shape) if cos.dim() == 2 else None  # shapes, not an unsqueeze op
    if (c is None or c[0] not in (1, b) or c[1] not in (1, seq)
            or not 0 < c[2] <= d or c[2] % 2):
        raise KprofError(f"apply_rope: cos/sin must be [B, S, R], [1, S, R] or [S, R] with B={b}, S={seq} and R "
                         f"even, 0 < R <= D={d} (R < D: partial rotary); got {tuple(cos.shape)}")
    return unsqueeze_dim


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None, unsqueeze_dim: int = 1, *, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, Hugging Face rotate-half convention, in one launch.

    Matches transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`:
    `q * cos + rotate_half(q) * sin` (same for k), with cos/sin unsqueezed at `unsqueeze_dim`.
    With cos/sin narrower than the head dim (R < D, partial rotary), GPT-NeoX's and Phi's form:
    the first R of each head rotated (halves of R), the other D - R passed through.

    interleaved=True: pairs (2i, 2i + 1) instead of (i, i + R/2), torchtitan's and Meta Llama's
    complex form `view_as_complex(x.reshape(..., -1, 2)) * freqs_cis`; cos/sin then hold each
    pair's value twice, `freqs_cis.real.repeat_interleave(2, -1)` and the same of `.imag`.

    Shapes: q [B, Hq, S, D] and k [B, Hk, S, D] (Hq != Hk for GQA) with unsqueeze_dim=1, or
    [B, S, Hq, D] / [B, S, Hk, D] with unsqueeze_dim=2; cos/sin [B, S, D], [1, S, D] or [S, D]
    (a 2-D cos is taken as [S, D]), or R < D wide for partial rotary; D and R even. Any q/k
    strides with a unit last-dim stride are read in place (e.g. `proj(x).view(B, S, H, D).transpose(1, 2)`).

    Dtypes: q, k in float32/float16/bfloat16; the outputs have torch's promoted dtype of q and
    cos, as eager's `q * cos` does (HF casts cos to q's dtype, so normally q's dtype). Math in
    fp32 with one rounding on store; eager rounds after each of its three bf16 ops, so bf16
    outputs can differ from eager by an ulp or two (and are closer to the exact value).

    position_ids: unused, as in transformers 4.4x (accepted for signature compatibility). An
    int in its place is taken as unsqueeze_dim, because transformers >= 5 dropped position_ids
    and passes unsqueeze_dim fifth.

    Backward: the rotation's transpose (rotate with -sin), in one launch for dq and dk. cos
    and sin get no gradient (HF computes them from a buffer without grad).
    """
    unsqueeze_dim = _normalize(q, k, cos, sin, position_ids, unsqueeze_dim)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise KprofError(
            "apply_rope: cos/sin require grad, but the kernel gives them none (HF builds them under no_grad); "
            "pass cos.detach(), sin.detach(), or use apply_rope_reference if they are learned"
        )
    if use_triton(q):
        return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim, interleaved)
    warn_fallback("rope", f"no Triton for tensors on {q.device} (set TRITON_INTERPRET=1 for the interpreter)")
    return apply_rope_reference(q, k, cos, sin, None, unsqueeze_dim, interleaved=interleaved)


# ---------------------------------------------------------------------------------------------
# 6. nn.Module: none. RoPE has no parameters and HF calls it as a function; `apply` patches
# `apply_rotary_pos_emb` with `apply_rope` directly.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# 7. Reference
# ---------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved rotate_half: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None, unsqueeze_dim: int = 1, *, interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch, same semantics as `apply_rope`: HF's formula with math in fp32 (fp64
    stays fp64) and one cast to the promoted dtype of q and cos; with cos/sin narrower than the
    head dim, transformers' GPT-NeoX form (rotate q[..., :R], cat q[..., R:] back); interleaved,
    rotate_half's pairs (i, i + R/2) become (2i, 2i + 1)."""
    unsqueeze_dim = _normalize(q, k, cos, sin, position_ids, unsqueeze_dim, DTYPES + (torch.float64,))
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    work = torch.promote_types(out_dtype, torch.float32)
    c = (cos if cos.dim() == 3 else cos.unsqueeze(0)).to(work).unsqueeze(unsqueeze_dim)
    s = (sin if sin.dim() == 3 else sin.unsqueeze(0)).to(work).unsqueeze(unsqueeze_dim)
    r = c.shape[-1]
    qf, kf = q.to(work), k.to(work)
    q_rot, q_pass, k_rot, k_pass = qf[..., :r], qf[..., r:], kf[..., :r], kf[..., r:]
    rot = _rotate_pairs if interleaved else _rotate_half
    q_embed = torch.cat([q_rot * c + rot(q_rot) * s, q_pass], dim=-1)
    k_embed = torch.cat([k_rot * c + rot(k_rot) * s, k_pass], dim=-1)
    return q_embed.to(out_dtype), k_embed.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# 8. Registry
# ---------------------------------------------------------------------------------------------

# FLOPs per rotated output element: two multiplies and one add (fwd and bwd alike); the
# pass-through part of a partial rotary (rot_dim < head_dim) is a copy: bytes, no FLOPs.
_FLOPS_PER_ELEM = 3


def _cost(
    batch: int, seq: int, n_q_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
    cos_batch: int = 1, cos_dtype: torch.dtype | None = None, rot_dim: int | None = None, **_,
) -> dict[str, Cost]:
    e = torch.empty((), dtype=dtype).element_size()
    ce = torch.empty((), dtype=cos_dtype or dtype).element_size()
    rot_dim = rot_dim or head_dim
    n = batch * seq * (n_q_heads + n_kv_heads) * head_dim  # q and k elements
    cs = 2 * cos_batch * seq * rot_dim * ce  # cos and sin, read once
    rotated = n // head_dim * rot_dim
    c = Cost(flops=_FLOPS_PER_ELEM * rotated, bytes=2 * n * e + cs)  # read q, k; write both; read cos, sin
    return {"fwd": c, "bwd": c}


def _op_cost(metas: list[TensorMeta]) -> Cost:
    """metas: q (or dq), k (or dk), cos, sin. Output dtype taken as q's (HF casts cos to it)."""
    q, k, cos, sin = metas[:4]
    e = torch.empty((), dtype=q.dtype).element_size()
    ce = torch.empty((), dtype=cos.dtype).element_size()
    n = math.prod(q.shape) + math.prod(k.shape)
    rotated = n // q.shape[-1] * cos.shape[-1] if q.shape[-1] else 0
    return Cost(flops=_FLOPS_PER_ELEM * rotated, bytes=2 * n * e + (math.prod(cos.shape) + math.prod(sin.shape)) * ce)


SPEC = register(
    KernelSpec(
        name="rope",
        replaces="transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, same for k; "
        "torchtitan's apply_rotary_emb (complex multiplication by freqs_cis, interleaved=True)",
        dtypes=DTYPES,
        limits="q/k 4-D, head_dim even, any head_dim (half-dims > 128 loop in blocks); cos/sin [B|1, S, R] or [S, R] "
        "with R = D or, partial rotary, even R < D; no grad for cos/sin",
        deterministic=True,  # pure elementwise, no reductions
        fn=apply_rope,
        module=None,
        reference=apply_rope_reference,
        cost=_cost,
        op_costs={"kprof::rope_fwd": _op_cost, "kprof::rope_bwd": _op_cost},
    )
)

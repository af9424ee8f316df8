"""Fused rotary position embedding (Hugging Face rotate-half convention) for q and k in one launch.

Eager code (transformers' `apply_rotary_pos_emb`):

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)              # [B, 1, S, D]
    q_embed = q * cos + rotate_half(q) * sin                    # rotate_half: cat(-x2, x1)
    k_embed = k * cos + rotate_half(k) * sin

is ~10 elementwise kernels (two slices, neg, cat, two muls, add; per tensor) and as many
round trips of q and k through memory. Here one program per (batch, position) loads that
position's cos/sin row once and rotates all q heads and all k heads with it:

    out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h]
    out[h:] = x[h:] * cos[h:] + x[:h] * sin[h:]          (h = D / 2)

Napkin math (H200, 4.27 TB/s), q and k both [8, 32, 2048, 128] bf16 (134 MB each):
    fwd: read q, k + write q_embed, k_embed = 4 * 134 MB = 537 MB -> 126 us floor
    bwd: read dq_embed, dk_embed + write dq, dk = 537 MB -> 126 us (fwd+bwd 251 us)
cos and sin ([B, S, D], 4 MB each here) are read once per position, not once per head.

Layouts: q/k are addressed through their strides, so the usual non-contiguous inputs - a
`[B, S, H, D]` projection view transposed to `[B, H, S, D]`, or a slice of a fused qkv
projection - are read in place, without a copy. Outputs are allocated with `torch.empty_like(q)`,
i.e. in the same memory layout as q when q is dense (as eager's elementwise ops do).
Only a last-dim stride != 1 forces a copy (and a contiguous output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels._common import use_triton, warn_fallback
from kprof.kernels.registry import Cost, KernelSpec, TensorMeta, register

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# 1. Triton kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, x_base, o_base, x_head_stride, o_head_stride, n_heads, half, d, d_ok,
    cos1, cos2, sin1, sin2, BLOCK_H: tl.constexpr,
):
    """Rotate every head of one (batch, position) for one block of the half dim `d` ([1, BLOCK_D])."""
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        ok = (h < n_heads) & d_ok
        x_off = x_base + h * x_head_stride + d
        o_off = o_base + h * o_head_stride + d
        x1 = tl.load(x_ptr + x_off, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_off + half, mask=ok, other=0.0).to(tl.float32)
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
        tl.store(o_ptr + o_off, o1.to(o_ptr.dtype.element_ty), mask=ok)
        tl.store(o_ptr + o_off + half, o2.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
    seq_len, n_q_heads, n_k_heads, half,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss,
    qo_sb, qo_sh, qo_ss, ko_sb, ko_sh, ko_ss,
    c_sb, c_ss,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr,
):
    """One program per (batch, position): all q heads and all k heads, strides [B, H, S, D]
    with unit last-dim stride. cos/sin are [B, S, D] (stride 0 where broadcast)."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    c_base = b * c_sb + s * c_ss
    for d0 in range(0, half, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        d_ok = d < half
        cos1 = tl.load(cos_ptr + c_base + d, mask=d_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + c_base + half + d, mask=d_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + c_base + d, mask=d_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + c_base + half + d, mask=d_ok, other=0.0).to(tl.float32)
        if BACKWARD:
            # The forward is linear in x with matrix [[C1, -S1], [S2, C2]] (per d); its transpose
            # [[C1, S2], [-S1, C2]] is the forward's form with (sin1, sin2) -> (-sin2, -sin1).
            # With HF's cos/sin (both halves equal) that is "rotate by -sin".
            neg_sin2 = -sin2
            sin2 = -sin1
            sin1 = neg_sin2
        _rotate_heads(q_ptr, qo_ptr, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, q_sh, qo_sh, n_q_heads,
                      half, d, d_ok, cos1, cos2, sin1, sin2, BLOCK_H)
        _rotate_heads(k_ptr, ko_ptr, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, k_sh, ko_sh, n_k_heads,
                      half, d, d_ok, cos1, cos2, sin1, sin2, BLOCK_H)


# ---------------------------------------------------------------------------------------------
# 2. Host launchers
# ---------------------------------------------------------------------------------------------

# Half-dims wider than this loop inside the program (head_dim 128 -> one 64-wide block; only
# exotic head dims > 256 loop). Keeps the tile bounded for any head_dim.
MAX_BLOCK_D = 128
# Elements per half-tile: [BLOCK_H, BLOCK_D] = [32, 64] for Llama's 32 heads x 128 -> all heads
# of a position in one iteration; x1, x2, o1, o2 at 4 warps is 64 fp32 values per thread.
TILE_ELEMS = 2048


@dataclass(frozen=True)
class RopeConfig:
    """Launch parameters; first guesses from the tile budget above, not yet swept on the H200."""

    block_h: int
    block_d: int
    num_warps: int

    @staticmethod
    def for_shape(n_heads: int, half: int) -> "RopeConfig":
        block_d = min(triton.next_power_of_2(max(half, 1)), MAX_BLOCK_D)
        block_h = max(1, min(triton.next_power_of_2(max(n_heads, 1)), TILE_ELEMS // block_d))
        num_warps = 4 if block_h * block_d <= 1024 else 8
        return RopeConfig(block_h=block_h, block_d=block_d, num_warps=num_warps)


def _bhsd(t: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """View in [B, H, S, D] order (no copy): unsqueeze_dim=1 is already [B, H, S, D];
    unsqueeze_dim=2 means [B, S, H, D]."""
    return t if unsqueeze_dim == 1 else t.transpose(1, 2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _out_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Output in t's memory layout when t is dense with unit last-dim stride (as eager's
    elementwise ops do), else contiguous: the kernel writes with unit last-dim stride."""
    if t.stride(-1) == 1 or t.shape[-1] <= 1:
        return torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def _cos_bsd(c: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """cos/sin as [B, S, D] with broadcast strides; 2-D [S, D] is taken as [1, S, D]."""
    c = c if c.dim() == 3 else c.unsqueeze(0)
    return _unit_last(c).expand(batch, seq, c.shape[-1])


def _rope_launch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
    out_dtype: torch.dtype, backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = _out_like(q, out_dtype), _out_like(k, out_dtype)
    if qo.numel() == 0 and ko.numel() == 0:
        return qo, ko
    qv, kv = _unit_last(_bhsd(q, unsqueeze_dim)), _unit_last(_bhsd(k, unsqueeze_dim))
    qov, kov = _bhsd(qo, unsqueeze_dim), _bhsd(ko, unsqueeze_dim)
    batch, n_q_heads, seq, head_dim = qv.shape
    n_k_heads = kv.shape[1]
    cos3, sin3 = _cos_bsd(cos, batch, seq), _cos_bsd(sin, batch, seq)
    if cos3.stride() != sin3.stride():
        sin3 = sin3.contiguous()
        cos3 = cos3.contiguous()
    half = head_dim // 2
    cfg = RopeConfig.for_shape(max(n_q_heads, n_k_heads), half)
    _rope_kernel[(batch * seq,)](
        qv, kv, qov, kov, cos3, sin3,
        seq, n_q_heads, n_k_heads, half,
        qv.stride(0), qv.stride(1), qv.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
        qov.stride(0), qov.stride(1), qov.stride(2), kov.stride(0), kov.stride(1), kov.stride(2),
        cos3.stride(0), cos3.stride(1),
        BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, BACKWARD=backward, num_warps=cfg.num_warps,
    )
    return qo, ko


# ---------------------------------------------------------------------------------------------
# 3. torch.library custom ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("kprof::rope_fwd", mutates_args=())
def rope_fwd_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    return _rope_launch(q, k, cos, sin, unsqueeze_dim, out_dtype, backward=False)


@rope_fwd_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    return _out_like(q, out_dtype), _out_like(k, out_dtype)


@torch.library.custom_op("kprof::rope_bwd", mutates_args=())
def rope_bwd_op(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_launch(dq, dk, cos, sin, unsqueeze_dim, dq.dtype, backward=True)


@rope_bwd_op.register_fake
def _(dq, dk, cos, sin, unsqueeze_dim):
    return _out_like(dq, dq.dtype), _out_like(dk, dk.dtype)


# ---------------------------------------------------------------------------------------------
# 4. autograd
# ---------------------------------------------------------------------------------------------


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim):
        q_embed, k_embed = rope_fwd_op(q, k, cos, sin, unsqueeze_dim)
        ctx.save_for_backward(cos, sin)
        ctx.unsqueeze_dim = unsqueeze_dim
        ctx.in_dtype = q.dtype
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_bwd_op(dq_embed, dk_embed, cos, sin, ctx.unsqueeze_dim)
        if dq.dtype != ctx.in_dtype:  # only when cos/sin promoted the output (e.g. fp32 cos, bf16 q)
            dq, dk = dq.to(ctx.in_dtype), dk.to(ctx.in_dtype)
        # No grads for cos/sin: HF builds them from a buffer under no_grad.
        return dq, dk, None, None, None


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
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) != 1:
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
    c = cos if cos.dim() == 3 else cos.unsqueeze(0) if cos.dim() == 2 else None
    if c is None or c.shape[0] not in (1, b) or c.shape[1] not in (1, seq) or c.shape[2] != d:
        raise KprofError(f"apply_rope: cos/sin must be [B, S, D], [1, S, D] or [S, D] with B={b}, S={seq}, D={d}; "
                         f"got {tuple(cos.shape)}")
    return unsqueeze_dim


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None, unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, Hugging Face rotate-half convention, in one launch.

    Matches transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`:
    `q * cos + rotate_half(q) * sin` (same for k), with cos/sin unsqueezed at `unsqueeze_dim`.

    Shapes: q [B, Hq, S, D] and k [B, Hk, S, D] (Hq != Hk for GQA) with unsqueeze_dim=1, or
    [B, S, Hq, D] / [B, S, Hk, D] with unsqueeze_dim=2; cos/sin [B, S, D], [1, S, D] or [S, D]
    (a 2-D cos is taken as [S, D]). D even. Any q/k strides with a unit last-dim stride are read
    in place (e.g. `proj(x).view(B, S, H, D).transpose(1, 2)`).

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
        return RopeFunction.apply(q, k, cos, sin, unsqueeze_dim)
    warn_fallback("rope", f"no Triton for tensors on {q.device} (set TRITON_INTERPRET=1 for the interpreter)")
    return apply_rope_reference(q, k, cos, sin, None, unsqueeze_dim)


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


def apply_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None, unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch, same semantics as `apply_rope`: HF's formula with math in fp32 (fp64
    stays fp64) and one cast to the promoted dtype of q and cos."""
    unsqueeze_dim = _normalize(q, k, cos, sin, position_ids, unsqueeze_dim, DTYPES + (torch.float64,))
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    work = torch.promote_types(out_dtype, torch.float32)
    c = (cos if cos.dim() == 3 else cos.unsqueeze(0)).to(work).unsqueeze(unsqueeze_dim)
    s = (sin if sin.dim() == 3 else sin.unsqueeze(0)).to(work).unsqueeze(unsqueeze_dim)
    qf, kf = q.to(work), k.to(work)
    q_embed = qf * c + _rotate_half(qf) * s
    k_embed = kf * c + _rotate_half(kf) * s
    return q_embed.to(out_dtype), k_embed.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# 8. Registry
# ---------------------------------------------------------------------------------------------

# FLOPs per output element: two multiplies and one add (fwd and bwd alike).
_FLOPS_PER_ELEM = 3


def _cost(
    batch: int, seq: int, n_q_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
    cos_batch: int = 1, cos_dtype: torch.dtype | None = None, **_,
) -> dict[str, Cost]:
    e = torch.empty((), dtype=dtype).element_size()
    ce = torch.empty((), dtype=cos_dtype or dtype).element_size()
    n = batch * seq * (n_q_heads + n_kv_heads) * head_dim  # q and k elements
    cs = 2 * cos_batch * seq * head_dim * ce  # cos and sin, read once
    c = Cost(flops=_FLOPS_PER_ELEM * n, bytes=2 * n * e + cs)  # read q, k; write both; read cos, sin
    return {"fwd": c, "bwd": c}


def _op_cost(metas: list[TensorMeta]) -> Cost:
    """metas: q (or dq), k (or dk), cos, sin. Output dtype taken as q's (HF casts cos to it)."""
    q, k, cos, sin = metas[:4]
    e = torch.empty((), dtype=q.dtype).element_size()
    ce = torch.empty((), dtype=cos.dtype).element_size()
    n = math.prod(q.shape) + math.prod(k.shape)
    return Cost(flops=_FLOPS_PER_ELEM * n, bytes=2 * n * e + (math.prod(cos.shape) + math.prod(sin.shape)) * ce)


SPEC = register(
    KernelSpec(
        name="rope",
        replaces="transformers' apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, same for k",
        dtypes=DTYPES,
        limits="q/k 4-D, head_dim even, any head_dim (half-dims > 128 loop in blocks); cos/sin [B|1, S, D] or [S, D]; "
        "no grad for cos/sin",
        deterministic=True,  # pure elementwise, no reductions
        fn=apply_rope,
        module=None,
        reference=apply_rope_reference,
        cost=_cost,
        op_costs={"kprof::rope_fwd": _op_cost, "kprof::rope_bwd": _op_cost},
    )
)

"""MoE dispatch: tokens to expert-contiguous order (permute) and back with the routing weights
applied (unpermute), without a host sync.

Why: eager dispatch (HF Mixtral's loop, `torch.where(expert_mask[e])` per expert, `index_add_`)
reads the routed count back to the host once per expert, and the combine is a separate
multiply and scatter-add per expert. Here the row positions come from the router's offsets on the
device, and the weighted sum over a token's k expert outputs is one gather pass.

Layout: slot (t, j) (token t's j-th expert e = indices[t, j]) goes to row
`pos[t, j] = start[e] + (number of slots before (t, j) in token-major order routed to e)`, where
start[e] = offsets[e - 1] (0 for e = 0). That is the order of a stable sort of the flattened
indices, so it is deterministic and each expert's rows stay in token order.

Kernels (Triton; the `*_reference` functions are eager PyTorch):
- `_hist_kernel`: per chunk of CHUNK slots, how many go to each expert -> [chunks, E];
  an exclusive `cumsum` over chunks gives each chunk's base per expert (no host sync);
- `_scatter_rows_kernel` (permute forward): rank within the chunk, pos, and the row copy
  x[t] -> xp[pos]; the same kernel writes w * dy -> d_yp[pos] in unpermute's backward;
- `_gather_rows_kernel` (unpermute forward, permute backward): y[t] = sum_j w[t, j] yp[pos[t, j]]
  (w = 1 for the permute's backward), accumulated in fp32;
- unpermute's backward also needs d_w[t, j] = <dy[t], yp[pos[t, j]]>, from the scatter kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels.common import FP_FUSION, device_ctx, use_triton, warn_fallback
from kprof.kernels.registry import Cost, KernelSpec, register

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Slots per chunk: the rank within a chunk compares every pair ([CHUNK, CHUNK] = 16K values).
CHUNK = 128
BLOCK_E = 64  # experts per step of the histogram loop
BLOCK_H = 128  # columns per step of the row loops
BLOCK_T = 16  # tokens per program of the gather


# --------------------------------------------------------------------------------------------
# 1. Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _hist_kernel(idx_ptr, hist_ptr, n_slots, n_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    s = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(idx_ptr + s, mask=s < n_slots, other=-1)
    for e0 in range(0, n_experts, BLOCK_E):
        ecols = e0 + tl.arange(0, BLOCK_E)
        n = tl.sum((ids[:, None] == ecols[None, :]).to(tl.int32), 0)
        tl.store(hist_ptr + c.to(tl.int64) * n_experts + ecols, n, mask=ecols < n_experts)


@triton.jit
def _scatter_rows_kernel(src_ptr, src_stride, dst_ptr, idx_ptr, base_ptr, offs_ptr, pos_ptr, w_ptr,
                         yp_ptr, dw_ptr, n_slots, n_experts, n_cols, K: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_H: tl.constexpr, COMPUTE_POS: tl.constexpr, WEIGHTED: tl.constexpr):
    """dst[pos[s]] = w[s] * src[s // K] for the CHUNK slots s of this program.

    COMPUTE_POS: pos from the chunk bases and offsets (permute forward), else read from pos_ptr.
    WEIGHTED (unpermute backward): scale by w[s] and write dw[s] = <src[s // K], yp[pos[s]]>."""
    c = tl.program_id(0)
    s = c * CHUNK + tl.arange(0, CHUNK)
    smask = s < n_slots
    if COMPUTE_POS:
        ids = tl.load(idx_ptr + s, mask=smask, other=-1)
        r = tl.arange(0, CHUNK)
        same = (ids[:, None] == ids[None, :]) & (r[None, :] < r[:, None])
        rank = tl.sum(same.to(tl.int32), 1)
        base = tl.load(base_ptr + c.to(tl.int64) * n_experts + ids, mask=smask, other=0)
        start = tl.load(offs_ptr + ids - 1, mask=smask & (ids > 0), other=0)
        pos = start + base + rank
        tl.store(pos_ptr + s, pos, mask=smask)
    else:
        pos = tl.load(pos_ptr + s, mask=smask, other=0)
    tok = (s // K).to(tl.int64)
    if WEIGHTED:
        w = tl.load(w_ptr + s, mask=smask, other=0.0).to(tl.float32)
        dw = tl.zeros([CHUNK], tl.float32)
    for h0 in range(0, n_cols, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = smask[:, None] & (h[None, :] < n_cols)
        v = tl.load(src_ptr + tok[:, None] * src_stride + h[None, :], mask=m, other=0.0)
        dst = pos[:, None].to(tl.int64) * n_cols + h[None, :]
        if WEIGHTED:
            vf = v.to(tl.float32)
            y = tl.load(yp_ptr + dst, mask=m, other=0.0).to(tl.float32)
            dw += tl.sum(vf * y, 1)
            tl.store(dst_ptr + dst, (vf * w[:, None]).to(dst_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(dst_ptr + dst, v, mask=m)
    if WEIGHTED:
        tl.store(dw_ptr + s, dw, mask=smask)


@triton.jit
def _gather_rows_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, n_tokens, n_cols, K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr):
    """out[t] = sum_j w[t, j] * src[pos[t, j]] (w = 1 unless WEIGHTED), in fp32."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < n_tokens
    m = tmask[:, None] & (h[None, :] < n_cols)
    acc = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(pos_ptr + t.to(tl.int64) * K + j, mask=tmask, other=0).to(tl.int64)
        v = tl.load(src_ptr + p[:, None] * n_cols + h[None, :], mask=m, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t.to(tl.int64) * K + j, mask=tmask, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + t[:, None].to(tl.int64) * n_cols + h[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------
# 2. Launchers
# --------------------------------------------------------------------------------------------


def _scatter(src, dst, indices, offsets, pos, w=None, yp=None, dw=None, compute_pos=False):
    n_slots, k = indices.numel() if indices is not None else pos.numel(), (indices if indices is not None else pos).shape[1]
    n_experts = offsets.numel() if offsets is not None else 1
    base = None
    if compute_pos:
        chunks = triton.cdiv(n_slots, CHUNK)
        hist = torch.empty(chunks, n_experts, dtype=torch.int32, device=src.device)
        with device_ctx(src):
            _hist_kernel[(chunks,)](indices, hist, n_slots, n_experts, CHUNK=CHUNK, BLOCK_E=BLOCK_E, **FP_FUSION)
        base = torch.cumsum(hist, 0, dtype=torch.int32) - hist  # exclusive: slots of earlier chunks
    with device_ctx(src):
        _scatter_rows_kernel[(triton.cdiv(n_slots, CHUNK),)](
            src, src.stride(0), dst, indices, base, offsets, pos, w, yp, dw, n_slots, n_experts, src.shape[1],
            K=k, CHUNK=CHUNK, BLOCK_H=BLOCK_H, COMPUTE_POS=compute_pos, WEIGHTED=w is not None, **FP_FUSION)


def _gather(src, pos, w, n_tokens, dtype):
    out = torch.empty(n_tokens, src.shape[1], dtype=dtype, device=src.device)
    if n_tokens and src.shape[1]:
        grid = (triton.cdiv(n_tokens, BLOCK_T), triton.cdiv(src.shape[1], BLOCK_H))
        with device_ctx(src):
            _gather_rows_kernel[grid](src, pos, w, out, n_tokens, src.shape[1], K=pos.shape[1], BLOCK_T=BLOCK_T,
                                      BLOCK_H=BLOCK_H, WEIGHTED=w is not None, **FP_FUSION)
    return out


# --------------------------------------------------------------------------------------------
# 3. autograd.Functions
# --------------------------------------------------------------------------------------------


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, offsets):
        t, k = indices.shape
        xp = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        pos = torch.empty(t, k, dtype=torch.int32, device=x.device)
        if t:
            _scatter(x, xp, indices, offsets, pos, compute_pos=True)
        ctx.save_for_backward(pos)
        ctx.mark_non_differentiable(pos)
        return xp, pos

    @staticmethod
    def backward(ctx, dxp, _dpos):
        (pos,) = ctx.saved_tensors
        return _gather(dxp.contiguous(), pos, None, pos.shape[0], dxp.dtype), None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, yp, pos, weights):
        ctx.save_for_backward(yp, pos, weights)
        return _gather(yp, pos, weights, pos.shape[0], yp.dtype)

    @staticmethod
    def backward(ctx, dy):
        yp, pos, weights = ctx.saved_tensors
        dyp = torch.empty_like(yp)
        dw = torch.zeros(pos.shape, dtype=torch.float32, device=yp.device)
        if pos.numel():
            _scatter(dy.contiguous(), dyp, None, None, pos, w=weights, yp=yp, dw=dw)
        return dyp, None, dw.to(weights.dtype)


# --------------------------------------------------------------------------------------------
# 4. Public functions
# --------------------------------------------------------------------------------------------


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise KprofError(f"{name}: expected a 2-D float32/float16/bfloat16 tensor, got {tuple(x.shape)} {x.dtype}")


def moe_permute(x: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xp [T*k, H], pos [T, k] int32): x's rows copied to expert-contiguous order (the layout in
    the module docstring). indices [T, k] and offsets [E] as `moe_router` returns them (int32).
    Differentiable in x (the backward sums each token's k row grads)."""
    _check_rows("moe_permute", x)
    if indices.dim() != 2 or indices.shape[0] != x.shape[0] or offsets.dim() != 1:
        raise KprofError(f"moe_permute: indices must be [T={x.shape[0]}, k], offsets [E]; got {tuple(indices.shape)}, "
                         f"{tuple(offsets.shape)}")
    if not use_triton(x):
        warn_fallback("moe_permute", f"no Triton backend for {x.device.type} tensors")
        return moe_permute_reference(x, indices, offsets)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _PermuteFunction.apply(x, indices.to(torch.int32).contiguous(), offsets.to(torch.int32).contiguous())


def moe_unpermute(yp: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, H] with y[t] = sum_j weights[t, j] * yp[pos[t, j]], summed in fp32 and rounded once to
    yp's dtype. Differentiable in yp and weights."""
    _check_rows("moe_unpermute", yp)
    if pos.shape != weights.shape or pos.dim() != 2 or yp.shape[0] != pos.numel():
        raise KprofError(f"moe_unpermute: pos and weights must be [T, k] with T*k = yp rows; got {tuple(pos.shape)}, "
                         f"{tuple(weights.shape)}, yp {tuple(yp.shape)}")
    if not use_triton(yp):
        warn_fallback("moe_unpermute", f"no Triton backend for {yp.device.type} tensors")
        return moe_unpermute_reference(yp, pos, weights)
    return _UnpermuteFunction.apply(yp.contiguous(), pos.to(torch.int32).contiguous(), weights.contiguous())


# --------------------------------------------------------------------------------------------
# 5. References: a stable sort of the expert ids (eager PyTorch, no host sync either).
# --------------------------------------------------------------------------------------------


def moe_permute_reference(x: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor):
    t, k = indices.shape
    order = torch.sort(indices.flatten().long(), stable=True).indices  # row r of xp is slot order[r]
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    return x[order // k], pos.view(t, k).to(torch.int32)


def moe_unpermute_reference(yp: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    t, k = pos.shape
    acc = torch.promote_types(yp.dtype, torch.float32)  # fp32, or fp64 for the tests' fp64 run
    rows = yp[pos.flatten().long()].view(t, k, yp.shape[1])
    return (rows.to(acc) * weights.to(acc)[..., None]).sum(1).to(yp.dtype)


# --------------------------------------------------------------------------------------------
# 6. Registry: rows moved once each way (the index traffic is small next to H columns).
# --------------------------------------------------------------------------------------------


def _cost(n_tokens: int, hidden: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Cost]:
    rows = n_tokens * k * hidden * dtype.itemsize
    return {"fwd": Cost(flops=0, bytes=n_tokens * hidden * dtype.itemsize + rows),
            "bwd": Cost(flops=n_tokens * k * hidden, bytes=rows + n_tokens * hidden * dtype.itemsize)}


def _unpermute_cost(n_tokens: int, hidden: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Cost]:
    b = dtype.itemsize
    th, tkh = n_tokens * hidden, n_tokens * k * hidden
    return {"fwd": Cost(flops=2 * tkh, bytes=b * (tkh + th)),
            "bwd": Cost(flops=4 * tkh, bytes=b * (th + 2 * tkh))}  # read dy (per slot, cached), yp; write d_yp


MOE_PERMUTE_SPEC = register(KernelSpec(
    name="moe_permute", replaces="per-expert torch.where(mask) + x[idx] gathers (HF Mixtral's dispatch loop)",
    dtypes=SUPPORTED_DTYPES, limits="2-D x; int32 indices/offsets from moe_router; no host sync",
    deterministic=True, fn=moe_permute, module=None, reference=moe_permute_reference, cost=_cost))
MOE_UNPERMUTE_SPEC = register(KernelSpec(
    name="moe_unpermute", replaces="per-expert out * routing_weight + index_add_ (HF Mixtral's combine)",
    dtypes=SUPPORTED_DTYPES, limits="pos from moe_permute; fp32 accumulation of the k rows",
    deterministic=True, fn=moe_unpermute, module=None, reference=moe_unpermute_reference, cost=_unpermute_cost))


__all__ = ["moe_permute", "moe_permute_reference", "moe_unpermute", "moe_unpermute_reference"]

"""MoE router: softmax or sigmoid scores, top-k, optional renormalisation, per-expert counts and
offsets, in one kernel; its backward w.r.t. the logits.

Why: eager routing (HF Mixtral: `softmax(logits, dtype=float)`, `topk`, `/= sum`, then
`one_hot` or `bincount` and `cumsum` for the dispatch) is 6-9 kernels over [T, E] and [T, k] plus,
in most HF code, a host sync to size the per-expert loop. A token's logits row is 8-256 values:
one warp holds it, so scores, selection, weights, counts and the offsets' scan fit one launch.

Three implementations, one contract (`router_backend()` says which runs):
- "cuda": `csrc/moe_router.cu`, compiled at first use by `cuda_jit` into a disk cache keyed by
  source hash, GPU arch and torch version (a second process imports it without compiling);
- "triton": the same algorithm on [tokens, experts] tiles; counts by atomics, offsets by a
  `cumsum` (a second launch, no host sync); runs under the interpreter on CPU tensors;
- "reference": `moe_router_reference`, eager PyTorch.
CUDA tensors take "cuda", or "triton" with a one-line warning when the extension cannot be built
(no compiler, no nvcc, a compile error). $KPROF_MOE_ROUTER_BACKEND = auto (default) | cuda |
triton | reference forces one (cuda raises KprofError where it cannot build).

Contract: logits [T, E] (float32/16, bfloat16; any row stride), 1 <= k <= min(32, E). Returns
`RouterOutput(weights [T, k] float32, indices [T, k] int32, counts [E] int32, offsets [E] int32)`
with weights in descending order, offsets the inclusive cumulative counts (torch._grouped_mm's
`offs`). Selection is on the logits (softmax and sigmoid are monotonic); ties go to the lower
expert index; NaN logits rank as -inf (torch.topk ranks NaN first). Weights are computed in fp32
as HF does (`softmax(..., dtype=torch.float)`); sigmoid renormalisation divides by the plain sum.
Gradients flow to the logits through the weights only (indices, counts and offsets have none).
"""

from __future__ import annotations

import os
import warnings
from importlib import resources
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels import cuda_jit
from kprof.kernels.common import FP_FUSION, device_ctx, interpreter_enabled
from kprof.kernels.registry import Cost, KernelSpec, register

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_K = 32  # one warp: lane j keeps pick j (csrc/moe_router.cu)
BACKENDS = ("cuda", "triton", "reference")


class RouterOutput(NamedTuple):
    weights: torch.Tensor  # [T, k] float32, descending
    indices: torch.Tensor  # [T, k] int32
    counts: torch.Tensor  # [E] int32, tokens routed to each expert
    offsets: torch.Tensor  # [E] int32, inclusive ends of each expert's rows in expert order


# --------------------------------------------------------------------------------------------
# 1. Triton kernels (the fallback; the CUDA kernels are in csrc/moe_router.cu)
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(logits_ptr, stride, pid, n_tokens, n_experts, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < n_tokens
    cmask = cols < n_experts
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # NaN ranks as -inf, as in the CUDA kernel
    return rows, cols, rmask, cmask, x


@triton.jit
def _pick(tile, kcols, j):
    """Column j of a [BLOCK_T, K_PAD] tile as a [BLOCK_T] vector."""
    return tl.sum(tl.where(kcols[None, :] == j, tile, 0.0), 1)


@triton.jit
def _router_fwd_kernel(logits_ptr, stride, w_ptr, idx_ptr, counts_ptr, n_tokens, n_experts,
                       K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows, cols, rmask, cmask, x = _load_tile(logits_ptr, stride, tl.program_id(0), n_tokens, n_experts, BLOCK_T, BLOCK_E)
    kcols = tl.arange(0, K_PAD)
    vals = tl.full([BLOCK_T, K_PAD], float("-inf"), tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    taken = cols[None, :] < 0  # all False, [1, BLOCK_E]
    for j in tl.static_range(K):
        # Max over the experts not yet taken, then the lowest such index holding it (so -inf
        # logits and ties pick deterministically, as the CUDA kernel does).
        free = cmask[None, :] & (taken == 0)
        v = tl.max(tl.where(free, x, float("-inf")), 1)
        i = tl.min(tl.where(free & (x == v[:, None]), cols[None, :], BLOCK_E), 1)
        vals = tl.where(kcols[None, :] == j, v[:, None], vals)
        ids = tl.where(kcols[None, :] == j, i[:, None], ids)
        taken = taken | (cols[None, :] == i[:, None])
    kmask = kcols[None, :] < K
    if SIGMOID:
        w = tl.where(kmask, 1.0 / (1.0 + tl.exp(-vals)), 0.0)
        if RENORM:
            w = w / tl.sum(w, 1)[:, None]
    else:
        m = _pick(vals, kcols, 0)  # round 0 holds the row's max
        w = tl.where(kmask, tl.exp(vals - m[:, None]), 0.0)
        if RENORM:
            z = tl.sum(w, 1)
        else:
            z = tl.sum(tl.where(cmask[None, :], tl.exp(x - m[:, None]), 0.0), 1)
        w = w / z[:, None]
    out = rows[:, None].to(tl.int64) * K + kcols[None, :]
    omask = rmask[:, None] & kmask
    tl.store(w_ptr + out, w, mask=omask)
    tl.store(idx_ptr + out, ids, mask=omask)
    tl.atomic_add(counts_ptr + ids, tl.full([BLOCK_T, K_PAD], 1, tl.int32), mask=omask)


@triton.jit
def _router_bwd_kernel(logits_ptr, stride, w_ptr, idx_ptr, dw_ptr, dl_ptr, n_tokens, n_experts,
                       K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Formulas in csrc/moe_router.cu (router_bwd)."""
    rows, cols, rmask, cmask, x = _load_tile(logits_ptr, stride, tl.program_id(0), n_tokens, n_experts, BLOCK_T, BLOCK_E)
    kcols = tl.arange(0, K_PAD)
    at = rows[:, None].to(tl.int64) * K + kcols[None, :]
    kmask = rmask[:, None] & (kcols[None, :] < K)
    w = tl.load(w_ptr + at, mask=kmask, other=0.0)
    dw = tl.load(dw_ptr + at, mask=kmask, other=0.0)
    ids = tl.load(idx_ptr + at, mask=kmask, other=-1)
    dot = tl.sum(w * dw, 1)
    if SIGMOID:
        s = tl.zeros([BLOCK_T, K_PAD], tl.float32)
        for j in tl.static_range(K):
            lj = tl.sum(tl.where(cols[None, :] == _pick(ids, kcols, j)[:, None], tl.where(cmask[None, :], x, 0.0), 0.0), 1)
            s = tl.where(kcols[None, :] == j, (1.0 / (1.0 + tl.exp(-lj)))[:, None], s)
        s = tl.where(kmask, s, 0.0)
        if RENORM:
            ds = (dw - dot[:, None]) / tl.sum(s, 1)[:, None]
        else:
            ds = dw
        coef = ds * s * (1.0 - s)
    else:
        coef = w * (dw - dot[:, None])
    dl = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    if not SIGMOID and not RENORM:
        m = tl.max(x, 1)
        p = tl.where(cmask[None, :], tl.exp(x - m[:, None]), 0.0)
        dl = -p / tl.sum(p, 1)[:, None] * dot[:, None]
    for j in tl.static_range(K):
        hit = cols[None, :] == _pick(ids, kcols, j)[:, None]
        dl = tl.where(hit, _pick(coef, kcols, j)[:, None], dl)
    out = rows[:, None].to(tl.int64) * n_experts + cols[None, :]
    tl.store(dl_ptr + out, dl.to(dl_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


# --------------------------------------------------------------------------------------------
# 2. Launchers
# --------------------------------------------------------------------------------------------

# About 4096 fp32 values of logits per program (16 per thread at 8 warps), the tile size of
# kprof's streaming kernels (common.StreamConfig.TILE); not tuned for the router.
_TILE = 4096


def _tile(n_experts: int, k: int) -> dict:
    block_e = triton.next_power_of_2(n_experts)
    return dict(K=k, K_PAD=triton.next_power_of_2(k), BLOCK_T=max(1, min(64, _TILE // block_e)), BLOCK_E=block_e)


def _triton_fwd(logits: torch.Tensor, k: int, sigmoid: bool, renorm: bool) -> RouterOutput:
    t, e = logits.shape
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    counts = torch.zeros(e, dtype=torch.int32, device=logits.device)
    if t:
        cfg = _tile(e, k)
        with device_ctx(logits):
            _router_fwd_kernel[(triton.cdiv(t, cfg["BLOCK_T"]),)](
                logits, logits.stride(0), weights, indices, counts, t, e, SIGMOID=sigmoid, RENORM=renorm,
                **cfg, **FP_FUSION)
    return RouterOutput(weights, indices, counts, torch.cumsum(counts, 0, dtype=torch.int32))


def _triton_bwd(logits, weights, indices, dweights, sigmoid: bool, renorm: bool) -> torch.Tensor:
    t, e = logits.shape
    dlogits = torch.empty(t, e, dtype=logits.dtype, device=logits.device)
    if t:
        cfg = _tile(e, weights.shape[1])
        with device_ctx(logits):
            _router_bwd_kernel[(triton.cdiv(t, cfg["BLOCK_T"]),)](
                logits, logits.stride(0), weights, indices, dweights, dlogits, t, e, SIGMOID=sigmoid, RENORM=renorm,
                **cfg, **FP_FUSION)
    return dlogits


def extension_source() -> cuda_jit.ExtensionSource:
    csrc = resources.files("kprof.kernels").joinpath("csrc")
    return cuda_jit.ExtensionSource(
        name="moe_router",
        cpp={"moe_router_binding.cpp": csrc.joinpath("moe_router_binding.cpp").read_text()},
        cuda={"moe_router.cu": csrc.joinpath("moe_router.cu").read_text()},
        cuda_cflags=("-O3", "-std=c++17"),
    )


_ext_failed: dict[str, str] = {}  # arch -> why the extension could not be built


def _extension(device: torch.device):
    """The built extension for `device`'s arch, or a reason string."""
    arch = cuda_jit.arch_of(device)
    if arch in _ext_failed:
        return _ext_failed[arch]
    try:
        mod, _ = cuda_jit.load(extension_source(), arch)
        return mod
    except KprofError as e:
        _ext_failed[arch] = str(e).splitlines()[0]
        return _ext_failed[arch]


def _env_backend() -> str:
    b = os.environ.get("KPROF_MOE_ROUTER_BACKEND", "auto").strip().lower() or "auto"
    if b not in ("auto", *BACKENDS):
        raise KprofError(f"KPROF_MOE_ROUTER_BACKEND must be auto, cuda, triton or reference, got {b!r}")
    return b


_noticed: set[str] = set()


def router_backend(device: torch.device | str = "cuda") -> str:
    """Which implementation `moe_router` runs for tensors on `device`: "cuda", "triton" or
    "reference". On CUDA this builds (or loads from the cache) the CUDA extension; when that
    fails it warns once, in one line, and answers "triton"."""
    device = torch.device(device)
    forced = _env_backend()
    if forced == "reference":
        return "reference"
    triton_ok = device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())
    if forced == "triton":
        if not triton_ok:
            raise KprofError(f"KPROF_MOE_ROUTER_BACKEND=triton, but Triton cannot run on {device} tensors here")
        return "triton"
    if device.type != "cuda":
        if forced == "cuda":
            raise KprofError(f"KPROF_MOE_ROUTER_BACKEND=cuda, but the tensors are on {device}")
        return "triton" if triton_ok else "reference"
    ext = _extension(device)
    if not isinstance(ext, str):
        return "cuda"
    if forced == "cuda":
        raise KprofError(f"KPROF_MOE_ROUTER_BACKEND=cuda, but the CUDA router cannot be built: {ext}")
    if "cuda" not in _noticed:
        _noticed.add("cuda")
        warnings.warn(f"kprof.kernels.moe_router: CUDA kernel unavailable ({ext}); using the Triton kernel", stacklevel=3)
    return "triton"


# --------------------------------------------------------------------------------------------
# 3. autograd.Function
# --------------------------------------------------------------------------------------------


class _RouterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, sigmoid, renorm, backend):
        if backend == "cuda":
            out = RouterOutput(*_extension(logits.device).router_fwd(logits, k, sigmoid, renorm))
        else:
            out = _triton_fwd(logits, k, sigmoid, renorm)
        ctx.save_for_backward(logits, out.weights, out.indices)
        ctx.sigmoid, ctx.renorm, ctx.backend = sigmoid, renorm, backend
        ctx.mark_non_differentiable(out.indices, out.counts, out.offsets)
        return tuple(out)

    @staticmethod
    def backward(ctx, dweights, _di, _dc, _do):
        logits, weights, indices = ctx.saved_tensors
        if dweights is None:
            return None, None, None, None, None
        dweights = dweights.float().contiguous()
        if ctx.backend == "cuda":
            dl = _extension(logits.device).router_bwd(logits, weights, indices, dweights, ctx.sigmoid, ctx.renorm)
        else:
            dl = _triton_bwd(logits, weights, indices, dweights, ctx.sigmoid, ctx.renorm)
        return dl, None, None, None, None


# --------------------------------------------------------------------------------------------
# 4. Public function
# --------------------------------------------------------------------------------------------


def _check(logits: torch.Tensor, k: int, score: str, dtypes=SUPPORTED_DTYPES) -> None:
    if logits.dim() != 2:
        raise KprofError(f"moe_router: logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if logits.dtype not in dtypes:
        raise KprofError(f"moe_router: unsupported dtype {logits.dtype}; supported: {SUPPORTED_DTYPES}")
    if not 1 <= k <= min(MAX_K, logits.shape[1]):
        raise KprofError(f"moe_router: need 1 <= k <= min({MAX_K}, n_experts={logits.shape[1]}), got k={k}")
    if score not in ("softmax", "sigmoid"):
        raise KprofError(f"moe_router: score must be 'softmax' or 'sigmoid', got {score!r}")


def moe_router(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True) -> RouterOutput:
    """Route each token (a row of `logits`) to its top-k experts; see the module docstring for
    the contract. Differentiable in `logits` through the weights."""
    _check(logits, k, score)
    backend = router_backend(logits.device)
    if backend == "reference":
        return moe_router_reference(logits, k, score, renormalize)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return RouterOutput(*_RouterFunction.apply(logits, k, score == "sigmoid", renormalize, backend))


# --------------------------------------------------------------------------------------------
# 5. Reference: HF Mixtral's routing (softmax in fp32, topk, renormalise), with DeepSeek's sigmoid
# scores as the other option, and the counts/offsets its dispatch computes.
# --------------------------------------------------------------------------------------------


def moe_router_reference(logits: torch.Tensor, k: int, score: str = "softmax", renormalize: bool = True) -> RouterOutput:
    _check(logits, k, score, (*SUPPORTED_DTYPES, torch.float64))  # fp64: the tests' high-precision run
    x = logits.float() if logits.dtype != torch.float64 else logits
    scores = torch.softmax(x, dim=-1) if score == "softmax" else torch.sigmoid(x)
    weights, indices = torch.topk(scores, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    e = logits.shape[1]
    # scatter_add, not bincount: bincount reads the max back to the host on CUDA.
    counts = torch.zeros(e, dtype=torch.int32, device=logits.device).scatter_add_(
        0, indices.flatten(), torch.ones(indices.numel(), dtype=torch.int32, device=logits.device))
    return RouterOutput(weights, indices.to(torch.int32), counts, torch.cumsum(counts, 0, dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# 6. Registry: bytes are the logits read once, weights and indices written once (fwd); the
# logits, weights, indices and dweights read and dlogits written (bwd). FLOPs: the k selection
# rounds compare each logit (k * T * E), the softmax's exp and sum (2 * T * E); backward ~3 per
# logit.
# --------------------------------------------------------------------------------------------


def _cost(n_tokens: int, n_experts: int, k: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Cost]:
    b = dtype.itemsize
    te, tk = n_tokens * n_experts, n_tokens * k
    return {
        "fwd": Cost(flops=(k + 2) * te, bytes=b * te + 8 * tk + 8 * n_experts),
        "bwd": Cost(flops=3 * te, bytes=2 * b * te + 12 * tk),
    }


MOE_ROUTER_SPEC = register(KernelSpec(
    name="moe_router",
    replaces="softmax(logits, dtype=float) / sigmoid -> topk -> /= sum -> bincount/one_hot -> cumsum (HF Mixtral, "
             "Qwen-MoE, OLMoE, DeepSeek routing)",
    dtypes=SUPPORTED_DTYPES,
    limits="2-D logits, 1 <= k <= min(32, E); CUDA kernel where it builds, else Triton (one-line warning)",
    deterministic=True,  # selection and weights per token; counts are integer atomics
    fn=moe_router,
    module=None,
    reference=moe_router_reference,
    cost=_cost,
))


__all__ = ["RouterOutput", "extension_source", "moe_router", "moe_router_reference", "router_backend"]

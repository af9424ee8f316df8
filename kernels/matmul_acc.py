"""C (+)= A.T @ B for fused linear + cross-entropy's grad_W update, in Triton.

In `fused_linear_cross_entropy` every chunk of C tokens adds `dlogits_c.T @ h_c` into grad_W:
A = dlogits_c [K=C, M=V] (the chunk buffer, row-major), B = h_c [K=C, N=H], C = grad_W [V, H].
At the issue's shape (V=128256, H=4096) and Liger's memory (C=512 rows), cuBLAS runs this as
`nvjet_sm90_tst_128x256_64x4_2x1_v_badd_coopA_NTN`: 0.93 ms a chunk, 14.9 ms of a 42 ms step,
against 0.73 ms a chunk (as 512-row shares) when the same update runs at 2048 rows (profile
`sweep-ce-lce-h200-20261129T2305.txt`). Per 128 x 256 output tile the K=512 mainloop is ~6 us
of tensor-core work at the step's 1.5 GHz power-capped clock, and reading + writing the bf16 C
tile (128 KB) is ~3.5 us of that SM's share of DRAM bandwidth; the gap says the C traffic is
not hidden behind the math.

This kernel loads the C tile first (its latency then overlaps the K loop's loads and MMAs),
and keeps two CTAs on each SM, so one CTA's epilogue runs under the other's mainloop.

Layers: Triton kernel, launch configs, launcher, reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels._common import FP_FUSION

# --------------------------------------------------------------------------------------------
# 1. Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_mn(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Tile order: GROUP_M row blocks of C share each column sweep, so a group's A slices
    # ([K, GROUP_M * BLOCK_M], 128 KB a block at K=512) and B ([K, N], 4 MB) stay in L2 while
    # the group's C tiles stream through DRAM once.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@triton.jit
def _matmul_acc_kernel(
    c_ptr, a_ptr, b_ptr,
    M, N, K,
    stride_cm, stride_ak, stride_bk,
    ACCUMULATE: tl.constexpr,
    EVEN_MN: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m, pid_n = _tile_mn(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    mask_c = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        # Issued before the K loop: the C tile's DRAM latency overlaps the mainloop.
        if EVEN_MN:
            acc = tl.load(c_ptrs).to(tl.float32)
        else:
            acc = tl.load(c_ptrs, mask=mask_c, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A is [K, M] row-major: its [BLOCK_K, BLOCK_M] tile is transposed into the MMA (M-major
    # operand, which wgmma reads from shared memory as is).
    a_ptrs = a_ptr + rk[:, None].to(tl.int64) * stride_ak + rm[None, :]
    b_ptrs = b_ptr + rk[:, None].to(tl.int64) * stride_bk + rn[None, :]
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_MN and EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = (k * BLOCK_K + rk)[:, None] < K
            a = tl.load(a_ptrs, mask=k_ok & (rm[None, :] < M), other=0.0)
            b = tl.load(b_ptrs, mask=k_ok & (rn[None, :] < N), other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 blocks wrongly (see _common.py)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if EVEN_MN:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _matmul_acc_tma_kernel(
    c_desc, a_desc, b_desc, c_ptr,
    M, N, K, stride_cm,
    ACCUMULATE: tl.constexpr, C_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    # Hopper path: TMA descriptors (bounds handled by the copy engine) and a persistent loop
    # over tiles, so the next tile's loads are in flight while this tile's C is stored.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_mn(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        om = pid_m * BLOCK_M
        on = pid_n * BLOCK_N
        if ACCUMULATE and C_TMA:
            acc = c_desc.load([om, on]).to(tl.float32)
        elif ACCUMULATE:
            # C straight into registers: no shared-memory staging buffer (64 KB at 128 x 256)
            rm = om + tl.arange(0, BLOCK_M)
            rn = on + tl.arange(0, BLOCK_N)
            c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
            acc = tl.load(c_ptrs, mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([ki * BLOCK_K, om])
            b = b_desc.load([ki * BLOCK_K, on])
            acc = tl.dot(a.T, b, acc)
        c_desc.store([om, on], acc.to(c_desc.dtype))


# --------------------------------------------------------------------------------------------
# 2. Launch config
# --------------------------------------------------------------------------------------------


class GemmConfig(NamedTuple):
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # the persistent TMA kernel (CUDA, 16-byte aligned rows) instead of pointer loads
    ctas_per_sm: int = 1  # TMA kernel: persistent programs per SM
    flatten: bool = False  # TMA kernel: let Triton pipeline across tiles (tl.range flatten)
    c_tma: bool = True  # TMA kernel: load C through TMA (else plain loads into registers)


DEFAULT = GemmConfig()


# --------------------------------------------------------------------------------------------
# 3. Launcher
# --------------------------------------------------------------------------------------------


def _tma_ok(*ts: torch.Tensor) -> bool:
    # TMA: 16-byte aligned base and row stride, half-precision operands (fp32 would be tf32)
    return ts[0].dtype != torch.float32 and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def matmul_acc_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = True,
                config: GemmConfig = DEFAULT) -> torch.Tensor:
    """c [M, N] (+)= a.T @ b with a [K, M], b [K, N]; fp32 accumulation, one rounding into c.

    Rows of a, b and c must be contiguous (stride 1 along the last dim); c may be fp32 while a
    and b are half precision (an fp32 grad_W accumulator)."""
    k, m = a.shape
    if b.shape[0] != k or c.shape != (m, b.shape[1]):
        raise KprofError(f"matmul_acc_: c {tuple(c.shape)} += a.T {tuple(a.shape[::-1])} @ b {tuple(b.shape)} do not fit")
    if a.dtype != b.dtype:
        raise KprofError(f"matmul_acc_: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    for name, t in (("a", a), ("b", b), ("c", c)):
        if t.stride(-1) != 1:
            raise KprofError(f"matmul_acc_: {name}'s rows must be contiguous (stride {t.stride()})")
    n = b.shape[1]
    if m == 0 or n == 0:
        return c
    cfg = config
    if cfg.tma and c.is_cuda and _tma_ok(a, b, c):
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(_sm_count(c.device) * cfg.ctas_per_sm, triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n))
        _matmul_acc_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(c, [cfg.block_m, cfg.block_n]),
            TensorDescriptor.from_tensor(a, [cfg.block_k, cfg.block_m]),
            TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n]), c,
            m, n, k, c.stride(0), ACCUMULATE=accumulate, C_TMA=cfg.c_tma,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            NUM_PROGRAMS=programs, FLATTEN=cfg.flatten,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
        )
        return c
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_acc_kernel[grid](
        c, a, b, m, n, k, c.stride(0), a.stride(0), b.stride(0),
        ACCUMULATE=accumulate,
        EVEN_MN=m % cfg.block_m == 0 and n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        # fp32 inputs: full fp32 products, as cuBLAS gives torch by default (allow_tf32 is off)
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=not a.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )
    return c


# --------------------------------------------------------------------------------------------
# 4. Reference
# --------------------------------------------------------------------------------------------


def matmul_acc_reference(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = True) -> torch.Tensor:
    """What `matmul_acc_` computes, in fp32 (fp64 for fp32 inputs), rounded once into c."""
    wide = torch.float64 if a.dtype == torch.float32 else torch.float32
    out = a.to(wide).t() @ b.to(wide)
    if accumulate:
        out = out + c.to(wide)
    return c.copy_(out)

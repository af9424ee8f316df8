"""Hopper path of kprof's fused cross-entropy: one row per thread-block cluster, read once.

Why: the Triton kernel reads each row of logits twice (a 128256-wide bf16 row does not fit one
SM's registers) and takes 1.256-1.271 ms fwd+bwd at bf16 8192 x 128256 on the H200; sharing each
row across the CTAs of a cluster reads every logit from DRAM once: 1.107-1.115 ms in the same runs
(0.98 ms floor).

The kernel is CUDA C++ (`csrc/cross_entropy_sm90.cu`; its header says why Triton cannot express
it). It computes exactly what `cross_entropy._ce_fwd_kernel` computes (per-row loss and the
scaled gradient, in place or not) and is checked against the same reference,
`cross_entropy.cross_entropy_reference` (tests/kernels/test_cross_entropy_sm90.py). The launcher
`cross_entropy._ce_fwd_launch` tries it first and falls back to the Triton kernel whenever `plan`
says no or the CUDA toolchain is missing, so callers never see the difference except in time.

Built at first use with NVRTC (the library that ships with PyTorch's CUDA wheels; no nvcc, no
CUDA headers) and launched through the driver API with ctypes, on PyTorch's current stream (CUDA
graph capture works once the kernel is built: build outside a capture, e.g. by a warm-up call).

`KPROF_CE_BACKEND`: `auto` (default) uses this kernel where `plan` allows it; `triton` never
does; `cluster` requires it and raises KprofError where it cannot run (tests, benchmarks).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import math
import os
import sys
import warnings
from dataclasses import dataclass
from importlib import resources

import torch

from kprof.errors import KprofError

_KERNEL_NAME = b"kprof_ce_sm90"
# Rows up to this many columns take the Triton kernel's single-block path, which already reads
# every logit once (cross_entropy.CEConfig.single_block_max).
_MIN_COLS = 16384 + 1
# Per thread: up to 8 16-byte vectors of the row, whose exp values stay in fp32 registers from
# the sums to the gradient (64 registers for bf16, within 512 threads' 128; ptxas: 124 registers
# at 8 vectors, no spills).
_MAX_NV = 8
# (CTAs per cluster, threads per CTA, CTAs per SM, fewest vectors a thread) in order of
# preference. A CTA holds one row slice at a time and meets its cluster once per row, so each
# shape pays only where a row gives it enough work. Measured on the H200, graph time, bf16, the
# Triton kernel in the same runs:
#   V = 128256 (8192 rows): 4 x 512, 8 vectors a thread 1.107-1.115 ms; 8 x 256 x 2 CTAs an SM
#       1.154; 8 x 512 1.405; Triton 1.256-1.271
#   V = 256000 (4096 rows): 8 x 512, 8 vectors 1.104 ms; Triton 1.382
#   V = 50304: 8 x 256 x 2, 4 vectors 0.502 ms; 4 x 512 0.617; 8 x 512 0.937; Triton 0.596
#   V = 32000: 8 x 256 x 2, 2 vectors 0.362 ms; 4 x 512 0.456; Triton 0.363
#   V = 151936: 8 x 512, 5 vectors 1.568 ms against Triton 1.527: no shape here pays
# So clusters of 4 x 512 and 8 x 512 only when each thread holds its full 8 vectors (per_cta /
# threads > 7); otherwise two CTAs of 256 threads an SM (45-62 clusters resident instead of
# 15-30); a row that fits none of these (bf16 V in (131072, 229376]) goes to Triton.
_SHAPES = ((4, 512, 1, 7), (8, 256, 2, 0), (8, 512, 1, 7))
# Row slices per CTA in shared memory (ClusterConfig.nbuf); the H100/H200 opt-in limit is 227 KB
# a block.
_MAX_SMEM = 200 * 1024


@dataclass(frozen=True)
class ClusterConfig:
    cluster: int  # CTAs per cluster (one row split this many ways)
    threads: int  # threads per CTA
    nv: int  # 16-byte vectors per thread per row
    min_blocks: int  # CTAs per SM the launch bounds ask for
    n_clusters: int = 0  # persistent grid in clusters; 0 = as many as fit at once (occupancy query)
    # Row slices in shared memory: the current row + nbuf - 1 prefetched. Measured on the H200
    # (bf16 8192 x 128256, cluster 4 x 512): nbuf 2 1.107 ms, nbuf 3 1.245 ms (cluster 8 x 256:
    # 1.154 -> 1.210 ms); why the deeper prefetch is slower is not measured.
    nbuf: int = 2


def backend() -> str:
    b = os.environ.get("KPROF_CE_BACKEND", "auto").strip().lower() or "auto"
    if b not in ("auto", "triton", "cluster"):
        raise KprofError(f"KPROF_CE_BACKEND must be auto, triton or cluster, got {b!r}")
    return b


def plan(n_rows: int, n_cols: int, itemsize: int, row_strides: tuple[int, ...], ptrs: tuple[int, ...],
         capability: tuple[int, int]) -> ClusterConfig | str:
    """The launch config for this problem, or the reason the cluster kernel does not apply (then
    the Triton kernel runs). Pure: testable without a GPU."""
    vec = 16 // itemsize
    if capability < (9, 0):
        return f"needs thread-block clusters (sm_90+), device is sm_{capability[0]}{capability[1]}"
    if n_cols < _MIN_COLS:
        return f"V = {n_cols} fits the Triton kernel's one-read path (<= {_MIN_COLS - 1})"
    if n_cols % vec or any(s % vec for s in row_strides) or any(p % 16 for p in ptrs):
        return f"rows are not 16-byte aligned (V = {n_cols}, row strides {row_strides}, {itemsize}-byte elements)"
    if n_rows >= 2**31 or any(s >= 2**31 for s in row_strides):
        return "more than 2^31 rows or a row stride past 2^31 elements"
    for cluster, threads, blocks, min_nv in _SHAPES:
        per_cta = math.ceil(n_cols // vec / cluster)
        nv = math.ceil(per_cta / threads)
        if min_nv < nv <= _MAX_NV and 2 * per_cta * 16 * blocks <= _MAX_SMEM:
            return ClusterConfig(cluster, threads, nv, blocks)
    big = 8 * 512 * _MAX_NV * vec  # the largest shape, 8 x 512, full
    if n_cols > big:
        return f"V = {n_cols} is over the {big} columns a cluster holds ({itemsize}-byte logits)"
    return (f"V = {n_cols} ({itemsize}-byte logits) leaves the cluster shapes part-filled; measured slower than "
            "the Triton kernel there (bf16 151936 on the H200: 1.57 vs 1.53 ms)")


def smem_bytes(cfg: ClusterConfig, n_cols: int, itemsize: int) -> int:
    return cfg.nbuf * math.ceil(n_cols * itemsize // 16 / cfg.cluster) * 16


def _defines(cfg: ClusterConfig, dtype: torch.dtype, smoothing: bool, z_loss: bool, softcap: bool,
             compute_grad: bool) -> tuple[tuple[str, int], ...]:
    dt = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[dtype]
    return (("DT", dt), ("CLUSTER", cfg.cluster), ("THREADS", cfg.threads), ("NV", cfg.nv),
            ("MIN_BLOCKS", cfg.min_blocks), ("NBUF", cfg.nbuf), ("HAS_SMOOTHING", int(smoothing)), ("HAS_Z_LOSS", int(z_loss)),
            ("HAS_SOFTCAP", int(softcap)), ("COMPUTE_GRAD", int(compute_grad)))


def source() -> str:
    return resources.files("kprof.kernels").joinpath("csrc/cross_entropy_sm90.cu").read_text()


# ----------------------------------------------------------------------------------------------
# NVRTC (compile) and the driver API (load, occupancy, launch), through ctypes
# ----------------------------------------------------------------------------------------------


@functools.cache
def _nvrtc_library() -> ctypes.CDLL:
    """libnvrtc: $KPROF_NVRTC, then what PyTorch's CUDA wheel depends on (nvidia-cuda-nvrtc), then
    the system's."""
    major = (torch.version.cuda or "13").split(".")[0]
    candidates = [os.environ.get("KPROF_NVRTC", "")]
    for base in sys.path:
        candidates += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    candidates += [f"libnvrtc.so.{major}", "libnvrtc.so"]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    errors = []
    for name in candidates:
        if not name or "builtins" in name or ".alt." in name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        # NVRTC dlopens libnvrtc-builtins by name at compile time; a wheel's lib directory is not
        # on the loader path, so load the one beside it first.
        for b in sorted(glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so*"))):
            if ".alt." not in b:
                try:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        return lib
    raise KprofError(
        "NVRTC (libnvrtc) not found; install nvidia-cuda-nvrtc matching your CUDA, or set KPROF_NVRTC "
        f"to the library's path ({'; '.join(errors[-2:]) or 'no candidates'})"
    )


def compile_cubin(defines: tuple[tuple[str, int], ...], arch: str) -> bytes:
    """The kernel as a cubin for `arch` (e.g. 'sm_90'), with `defines` prepended."""
    nvrtc = _nvrtc_library()
    src = "".join(f"#define {k} {v}\n" for k, v in defines) + source()
    prog = ctypes.c_void_p()
    _nvrtc_check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"cross_entropy_sm90.cu", 0, None, None))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-default-device"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise KprofError(f"NVRTC could not compile cross_entropy_sm90.cu for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _nvrtc_check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(nvrtc: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise KprofError(f"NVRTC error {rc}: {nvrtc.nvrtcGetErrorString(rc).decode()}")


_libcuda: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def _cu_check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(rc, ctypes.byref(name))
        raise KprofError(f"CUDA driver error {rc} ({(name.value or b'?').decode()}) in {what}")


class _CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


@dataclass
class _Loaded:
    func: ctypes.c_void_p
    max_clusters: dict  # dynamic shared memory bytes -> clusters resident at once


_loaded: dict[tuple, _Loaded] = {}
_broken: dict[int, str] = {}  # device index -> why the cluster path failed there
# Launches per backend since import (tests check that the path they mean to test ran).
launches = {"cluster": 0}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _load(device: torch.device, defines) -> _Loaded:
    key = (device.index, defines)
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    major, minor = torch.cuda.get_device_capability(device)
    cubin = compile_cubin(defines, f"sm_{major}{minor}")
    cu = _cuda()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # makes PyTorch's (primary) context current on this thread
        mod, func = ctypes.c_void_p(), ctypes.c_void_p()
        _cu_check(cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        _cu_check(cu.cuModuleGetFunction(ctypes.byref(func), mod, _KERNEL_NAME), "cuModuleGetFunction")
        _cu_check(cu.cuFuncSetAttribute(func, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, _MAX_SMEM),
                  "cuFuncSetAttribute (dynamic shared memory)")
    hit = _Loaded(func, {})
    _loaded[key] = hit
    return hit


def _max_clusters(device: torch.device, k: _Loaded, cfg: ClusterConfig, smem: int) -> int:
    """Clusters resident at once (cuOccupancyMaxActiveClusters): the persistent grid. On the H200:
    30 clusters of 4 x 512 threads and 15 of 8 x 512 (120 of 132 SMs: a cluster lives inside one
    GPC), 45-62 of 8 x 256 at two CTAs an SM (by shared memory). Fewer than fit measured slower
    (30 -> 24 clusters of 4: 1.11 -> 1.28-1.30 ms at 8192 x 128256)."""
    n = k.max_clusters.get(smem)
    if n is None:
        lc = _CUlaunchConfig(cfg.cluster * 64, 1, 1, cfg.threads, 1, 1, smem, None, None, 0)
        out = ctypes.c_int(0)
        with torch.cuda.device(device):
            rc = _cuda().cuOccupancyMaxActiveClusters(ctypes.byref(out), k.func, ctypes.byref(lc))
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Without the query's answer, a guess that can only under-fill (never queue a cluster
        # behind the others, which would double the time of its rows).
        n = out.value if rc == 0 and out.value > 0 else max(1, sms // (2 * cfg.cluster))
        k.max_clusters[smem] = n
    return n


def try_launch(
    logits: torch.Tensor,
    target: torch.Tensor,
    grad: torch.Tensor | None,
    loss_rows: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    config: ClusterConfig | None = None,
) -> bool:
    """Run the cluster kernel if it applies (see `plan`, `backend`); False means the caller runs
    the Triton kernel. Arguments as `cross_entropy._ce_fwd_launch`'s."""
    mode = backend()
    if mode == "triton" or not logits.is_cuda:
        return False
    if mode == "auto" and softcap > 0.0 and config is None:
        # Measured slower with the softcap (H200, Gemma 4096 x 256000: 3.00 ms against the
        # Triton kernel's 2.48 ms): it recomputes tanh in each pass.
        return False
    dev = logits.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    n_rows, n_cols = logits.shape
    g = grad if grad is not None else logits
    cfg = config or plan(
        n_rows, n_cols, logits.element_size(), (logits.stride(0), g.stride(0)), (logits.data_ptr(), g.data_ptr()),
        torch.cuda.get_device_capability(dev),
    )
    if isinstance(cfg, str) or idx in _broken:
        if mode == "cluster":
            raise KprofError(f"KPROF_CE_BACKEND=cluster, but the cluster kernel cannot run: {cfg if isinstance(cfg, str) else _broken[idx]}")
        return False
    defines = _defines(cfg, logits.dtype, label_smoothing > 0.0, z_loss != 0.0, softcap > 0.0, grad is not None)
    try:
        k = _load(dev, defines)
    except (KprofError, OSError) as e:
        if mode == "cluster":
            raise
        _broken[idx] = str(e).splitlines()[0]
        warnings.warn(f"kprof cross_entropy: the sm_90 cluster kernel is unavailable ({_broken[idx]}); using the Triton kernel", stacklevel=3)
        return False
    smem = smem_bytes(cfg, n_cols, logits.element_size())
    n_clusters = min(n_rows, cfg.n_clusters or _max_clusters(dev, k, cfg, smem))
    tgt = target if target.dtype == torch.int64 else target.to(torch.int64)
    tgt = tgt.contiguous()
    vals = [
        ctypes.c_void_p(logits.data_ptr()), ctypes.c_int(logits.stride(0)), ctypes.c_void_p(tgt.data_ptr()),
        ctypes.c_void_p(g.data_ptr()), ctypes.c_int(g.stride(0)), ctypes.c_void_p(loss_rows.data_ptr()),
        ctypes.c_void_p(grad_scale.data_ptr()), ctypes.c_int(0 if grad_scale.numel() == 1 else 1),
        ctypes.c_int(n_rows), ctypes.c_int(n_cols), ctypes.c_longlong(ignore_index),
        ctypes.c_float(label_smoothing), ctypes.c_float(z_loss), ctypes.c_float(softcap),
    ]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
    if idx != torch.cuda.current_device():  # the function belongs to that device's context
        with torch.cuda.device(idx):
            rc = _cuda().cuLaunchKernel(k.func, n_clusters * cfg.cluster, 1, 1, cfg.threads, 1, 1, smem, stream, params, None)
    else:
        rc = _cuda().cuLaunchKernel(k.func, n_clusters * cfg.cluster, 1, 1, cfg.threads, 1, 1, smem, stream, params, None)
    if rc != 0:
        try:
            _cu_check(rc, "cuLaunchKernel (cross_entropy_sm90)")
        except KprofError as e:
            if mode == "cluster":
                raise
            # A refused launch (e.g. clusters not available under this sharing mode) is not sticky:
            # the Triton kernel runs, now and for this device from here on.
            _broken[idx] = str(e)
            warnings.warn(f"kprof cross_entropy: the sm_90 cluster kernel could not launch ({e}); using the Triton kernel", stacklevel=3)
            return False
    launches["cluster"] += 1
    return True


__all__ = ["ClusterConfig", "backend", "compile_cubin", "plan", "smem_bytes", "source", "try_launch"]

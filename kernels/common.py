"""Shared helpers for the kernel modules: where a kernel can run, and the tolerance table.

Where a kernel runs:
- CUDA tensors: the Triton kernel.
- CPU tensors with TRITON_INTERPRET=1 set before triton was imported (CI, tests): the same
  Triton kernel through Triton's interpreter. Note: the interpreter (Triton 3.9) computes
  bf16 arithmetic wrongly (`x * 2` on a bf16 block gives garbage); kernels upcast to fp32
  before any arithmetic, which is also what they must do on the GPU for accuracy. It also
  truncates fp32 -> bf16 casts instead of rounding to nearest (measured on 64K values), so CPU
  bf16 results can be one ulp off the GPU's; the bf16 tolerance covers that.
- CPU tensors otherwise: the pure-PyTorch reference, with a one-time warning.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch


# Every kprof launch compiles with FP fusion (a * b + c -> one FMA) on, explicitly. Triton <= 3.9
# fuses by default, 3.9 warns that 3.10 will not, and the kernels were tuned and measured fused.
# Measured on the H200 (2026-11-30 05:23-05:27, bench_kernels graphn_us, fused vs TRITON_DEFAULT_FP_FUSION=0,
# `bench-h200-20261130T0523-fpfusion-{on,off}.log`): bias+GELU erf fwd 283 -> 331 us and
# fwd+bwd 668 -> 748 us (94% -> 84% of copy bandwidth), LayerNorm fwd+bwd 186 -> 226 us (over
# its 200 us target), Gemma-softcap cross-entropy 2.51 -> 2.87 ms; RMSNorm, tanh GELU and plain
# cross-entropy unchanged. The kernels' tests pass either way (`pytest-gpu-kernels-nofpfusion-*`).
# A launch option, not the global knob: the user's own Triton kernels and Inductor keep theirs.
FP_FUSION = {"enable_fp_fusion": True}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """True if the Triton kernel can run on tensors on `t`'s device."""
    return t.is_cuda or (t.device.type == "cpu" and interpreter_enabled())


def via_custom_op() -> bool:
    """Whether a kernel call should go through its `torch.library` custom op.

    Only when it pays: under torch.compile (the opaque op keeps the graph whole) and while a
    profiler records (the trace then names `kprof::*` ops with their input shapes, which the cost
    model reads). Otherwise the autograd.Function calls the launcher directly, because on the
    H200 machine's host (Xeon, 2026-11-29, benchmarks/host_overhead.py) a custom-op call costs
    30 us against 24 us for the bare Triton launch, and a fwd+bwd through custom ops 244 us
    against 163 us: at these kernels' 65-200 us GPU times, host time decides the wall time.
    """
    return torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled()


_warned: set[str] = set()


def warn_fallback(kernel: str, why: str) -> None:
    if kernel not in _warned:
        _warned.add(kernel)
        warnings.warn(f"kprof.kernels.{kernel}: {why}; using the PyTorch reference", stacklevel=3)


class Tol(NamedTuple):
    atol: float
    rtol: float


# One tolerance table per dtype, for kernel-vs-reference checks (tests) and patch verification
# (apply). The reference runs on inputs upcast to fp32 (fp64 for fp32 inputs) and is cast back
# to the kernel's dtype. rtol is about two ulps of the dtype (fp16 2^-10, bf16 2^-7 - 1.6e-2 is
# torch.testing's bf16 default); fp32 allows for reordered fp32 reductions over up to 64K terms.
# Never widen an entry to make a test pass: find the bug.
TOLERANCE: dict[torch.dtype, Tol] = {
    torch.float32: Tol(atol=1e-5, rtol=2e-5),
    torch.float16: Tol(atol=1e-3, rtol=2e-3),
    torch.bfloat16: Tol(atol=1e-2, rtol=1.6e-2),
}


def tol(dtype: torch.dtype) -> Tol:
    return TOLERANCE[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = "") -> None:
    """torch.testing.assert_close with the table entry for `dtype` (default: actual's dtype)."""
    t = tol(dtype or actual.dtype)
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=t.atol, rtol=t.rtol, msg=msg or None)

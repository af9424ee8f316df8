"""MoE experts as grouped GEMMs: `down(silu(x W_gate) * (x W_up))` for every expert in two
launches (plus the activation), on rows already in expert-contiguous order (`moe_permute`).

Why: a loop over experts launches 3 GEMMs per expert (24 at 8 experts, 768 at 256) and needs each
expert's row count on the host (a sync per layer); `torch._grouped_mm` takes the counts as a
device tensor of offsets (`offs`, int32 inclusive ends, what `moe_router` returns) and runs all
experts in one launch. The gated activation runs between the two GEMMs as kprof's packed SwiGLU
(`glu.swiglu_packed`: reads the [N, 2I] gate|up once, writes [N, I]); it is not fused into the
GEMM's epilogue, which `_grouped_mm` does not expose (the Triton fallback below does fuse it).

`_grouped_mm` (torch 2.13 CPU, probed): float32 and bfloat16, forward and backward (the gradient
must be contiguous: an expanded one fails), int32 `offs` only (int64 raises), every stride a
multiple of 16 bytes (H, I multiples of 8 in bf16, of 4 in fp32), and rows past offs[-1] are left
uninitialised. Where a call is refused (another dtype or alignment, an older torch, a GPU
without support) `moe_experts` runs the Triton grouped GEMM (`moe_grouped_gemm`: both GEMMs and
the SwiGLU fused into the first one's epilogue, no host sync either) on CUDA tensors or under the
interpreter, and only where Triton cannot run either (CPU tensors without TRITON_INTERPRET) the
per-expert loop `moe_experts_reference`, which reads the offsets on the host, with a one-line
warning. `grouped_mm_backend` says which of the three runs.

Weights: w_gate_up [E, H, 2I] (gate in the first I columns, up in the second: the layout of
`swiglu_packed`), w_down [E, I, H]; any strides (e.g. transposed views of HF's stacked
[E, 2I, H] / [E, H, I] parameters): those `_grouped_mm` refuses go to the Triton path.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kprof.kernels.common import use_triton
from kprof.kernels.glu import swiglu_packed
from kprof.kernels.moe_grouped_gemm import SUPPORTED_DTYPES, check_experts_args, moe_grouped_gemm
from kprof.kernels.moe_grouped_gemm import moe_grouped_gemm_reference as moe_experts_reference
from kprof.kernels.registry import Cost, KernelSpec, register


def _aligned(*ts: torch.Tensor) -> bool:
    return all(s * t.element_size() % 16 == 0 for t in ts for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> str | None:
    """None if `_grouped_mm` runs forward and backward on this device and dtype (a tiny probe,
    once per process), else why not. Probed, not version-checked: the CUDA and CPU kernels
    differ by torch version, GPU arch and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        # enable_grad: the first caller may be under no_grad (a rule's match probe), and the cached
        # answer would then say "no backward" for the whole process.
        with torch.enable_grad():
            return _probe_grouped_mm(device_type, dtype)
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__


def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> None:
    x = torch.randn(3, 8, device=device_type, dtype=dtype, requires_grad=True)
    w = torch.randn(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
    offs = torch.tensor([1, 3], dtype=torch.int32, device=device_type)
    y = torch._grouped_mm(x, w, offs=offs)
    y.backward(torch.ones_like(y))


def _grouped_mm_refused(x: torch.Tensor, *weights: torch.Tensor) -> str | None:
    """None if torch._grouped_mm runs on these tensors, else why not."""
    why = _grouped_mm_works(x.device.type, x.dtype)
    if why is None and not _aligned(x, *weights):
        why = "strides not multiples of 16 bytes (H and I must be multiples of 16 / element size)"
    return why


def grouped_mm_backend(x: torch.Tensor, *weights: torch.Tensor) -> str:
    """Which backend `moe_experts` runs on these tensors: "grouped_mm" (torch._grouped_mm),
    "triton" (the Triton grouped GEMM) or "reference" (the per-expert loop)."""
    if _grouped_mm_refused(x, *weights) is None:
        return "grouped_mm"
    return "triton" if use_triton(x) else "reference"


_warned: set[str] = set()


def moe_experts(x: torch.Tensor, offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """[N, H] expert outputs for rows `x` [N, H] in expert-contiguous order (expert e owns rows
    [offsets[e-1], offsets[e])), N = offsets[-1]. Differentiable in x and both weights; no host
    sync except on the per-expert loop (see the module docstring)."""
    check_experts_args(x, offsets, w_gate_up, w_down)
    why = _grouped_mm_refused(x, w_gate_up, w_down)
    if why is not None:
        if use_triton(x):
            return moe_grouped_gemm(x, offsets, w_gate_up, w_down)
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"kprof.kernels.moe_experts: torch._grouped_mm unavailable ({why}) and no Triton backend "
                          f"for {x.device.type} tensors; using the per-expert loop", stacklevel=2)
        return moe_experts_reference(x, offsets, w_gate_up, w_down)
    if x.shape[0] == 0:
        return moe_experts_reference(x, offsets, w_gate_up, w_down)  # no rows: nothing to launch
    offs = offsets.to(torch.int32)
    h = torch._grouped_mm(x, w_gate_up, offs=offs)  # [N, 2I]
    return torch._grouped_mm(swiglu_packed(h), w_down, offs=offs)


def _cost(n_rows: int, hidden: int, inter: int, n_experts: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Cost]:
    """n_rows = T * k routed rows; each read once, every expert's weights read once."""
    b = dtype.itemsize
    flops = 2 * n_rows * hidden * 3 * inter
    w = n_experts * 3 * hidden * inter * b
    act = n_rows * (hidden + 3 * inter + hidden) * b  # x, gate|up, a, y
    return {"fwd": Cost(flops=flops, bytes=w + act), "bwd": Cost(flops=2 * flops, bytes=2 * (w + act))}


MOE_EXPERTS_SPEC = register(KernelSpec(
    name="moe_experts",
    replaces="a loop over experts of down(act(gate(x)) * up(x)) on each expert's rows",
    dtypes=SUPPORTED_DTYPES,
    limits="torch._grouped_mm where it runs (probed per device and dtype; strides 16-byte aligned), else the "
           "Triton grouped GEMM (moe_grouped_gemm) on CUDA or under the interpreter, else the per-expert loop "
           "with a warning",
    deterministic=False,  # _grouped_mm's weight-grad reduction order is not documented or tested here
    # (the Triton path alone is deterministic: MOE_GROUPED_GEMM_SPEC)
    fn=moe_experts, module=None, reference=moe_experts_reference, cost=_cost,
))


__all__ = ["grouped_mm_backend", "moe_experts", "moe_experts_reference"]

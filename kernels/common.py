"""Shared helpers for the kernel modules: where a kernel can run, the tolerance table, and the
row/launch helpers every row-wise kernel uses (rows as a 2-D view, block shapes and warps,
persistent grids, SM counts), so each is written once.

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

import contextlib
import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from kprof.errors import KprofError
from kprof.kernels._math import to_f32_fast


# Every kprof launch compiles with FP fusion (a * b + c -> one FMA) on, explicitly: Triton <= 3.9
# fuses by default, 3.10 will not, and the kernels were tuned fused. Without it, on the H200:
# bias+GELU erf fwd+bwd 668 -> 748 us, LayerNorm fwd+bwd 186 -> 226 us, Gemma-softcap
# cross-entropy 2.51 -> 2.87 ms (docs/kernels.md). A launch option, not the global knob: the
# user's own Triton kernels and Inductor keep theirs.
FP_FUSION = {"enable_fp_fusion": True}


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Read once: Triton itself reads TRITON_INTERPRET when it is imported, and the launchers are
# on the eager hot path (an environment lookup per call is ~1 us of host time).
_COMPILED = not interpreter_enabled()
# Whether launched kernels run in the interpreter (their EMULATE_RTNE / TREE_EMU constexprs).
INTERPRETED = not _COMPILED


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code. Triton 3.9's `triton.cdiv` and `triton.next_power_of_2` are
    ConstexprFunctions that unwrap every argument first: 4-7 of them per fwd+bwd were ~20% of
    rms_norm's wiring time under cProfile (benchmarks/host_cost_cpu.py)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Triton's `next_power_of_2` (the same bit trick, so the same result for every int) for
    host code; see `cdiv`."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1


def fast_math(t: torch.Tensor) -> bool:
    """Whether a kernel launched on t's device may use inline PTX (`_math`'s FAST)."""
    return _COMPILED and t.is_cuda


def use_triton(t: torch.Tensor) -> bool:
    """True if the Triton kernel can run on tensors on `t`'s device."""
    return t.is_cuda or (t.device.type == "cpu" and interpreter_enabled())


# --------------------------------------------------------------------------------------------
# The wiring every kernel shares: one registered op per direction, a lean eager path
# --------------------------------------------------------------------------------------------
#
# Each kernel direction is one Python function (the "body") that allocates its outputs and calls
# `launch` for each Triton kernel. It is wired twice:
# - eager: the autograd.Function calls the body directly (`via_custom_op()` False): no op
#   dispatch at all, because on the H200 machine's host a custom-op call costs 30 us against
#   24 us for the bare launch, and a fwd+bwd through custom ops 244 us against 163 us.
# - torch.compile (and a recording profiler): the autograd.Function calls the registered op
#   `kprof::<name>` made by `kernel_op`. Where Triton compiles kernels (a GPU) that op is a
#   `torch.library.triton_op`: Dynamo keeps it as one node (no graph break), and AOTAutograd
#   traces its body, so `launch` records each kernel as a `triton_kernel_wrapper_*` node that
#   Inductor launches from its own generated code instead of calling back into Python through
#   the dispatcher. Under the interpreter (CPU CI) `wrap_triton` cannot trace an interpreted
#   kernel, so the op is an opaque `torch.library.custom_op` with the given fake.


def kernel_op(name: str, *, mutates_args: Sequence[str] = ()):
    """Decorator: register a kernel body as the op `name` ("kprof::..."), see above. Its fake is
    the body itself, run on fake tensors (with compiled Triton its launches record, under the
    interpreter they are skipped); `@op.register_fake` may replace it with a shapes-only one,
    which Dynamo then runs instead (cheaper, and symbolic sizes never reach the launch plans).
    Under FunctionalTensorMode (AOTAutograd) a triton_op is still decomposed into its body."""

    def register(body):
        if _COMPILED:
            try:
                return torch.library.triton_op(name, body, mutates_args=tuple(mutates_args))
            except Exception as e:  # a torch without triton_op, or one that rejects this body
                warnings.warn(f"kprof: {name} registered as a plain custom op, not a triton_op ({e!r}); "
                              "under torch.compile it stays one opaque call", stacklevel=2)
        op = torch.library.custom_op(name, body, mutates_args=tuple(mutates_args))
        op.register_fake(body)
        return op

    return register


# Launch options that are not kernel arguments. Dynamo's kernel wrapper takes num_warps and
# num_stages as config; Inductor compiles user kernels with FP fusion on already
# (TritonKernel.triton_meta_common: enable_fp_fusion = not emulate_precision_casts) and has no
# maxnreg for them, so traced launches drop these two rather than pass them as kernel arguments.
_NOT_TRACED = ("enable_fp_fusion", "maxnreg")
_REAL_TENSORS = (torch.Tensor, torch.nn.Parameter)


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, or its traced form inside a `kernel_op` body being traced.

    The first argument must be a tensor (every kprof kernel starts with a pointer): a plain
    tensor means a real call (eager, or the op's own backend), launched at once; a fake or
    functional tensor means the body is being traced by torch.compile, and the launch goes
    through `torch.library.wrap_triton` so Inductor sees the kernel. One type check per launch
    (~0.1 us), not a context manager or a mode lookup."""
    if type(args[0]) in _REAL_TENSORS:
        kernel[grid](*args, **kwargs)
        return
    if not _COMPILED:
        return  # the interpreter's fake: shapes only, there is nothing to trace
    for k in _NOT_TRACED:
        kwargs.pop(k, None)
    torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


def via_custom_op() -> bool:
    """Whether a kernel call should go through its `torch.library` custom op.

    Only when it pays: under torch.compile (the opaque op keeps the graph whole) and while a
    profiler records (the trace then names `kprof::*` ops with their input shapes, which the cost
    model reads). Otherwise the autograd.Function calls the launcher directly, because on the
    H200 machine's host (benchmarks/host_overhead.py) a custom-op call costs 30 us against 24 us
    for the bare Triton launch, and a fwd+bwd through custom ops 244 us against 163 us: at these
    kernels' 65-200 us GPU times, host time decides the wall time.
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


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (inf where one side is finite and the other not)."""
    a, b = a.detach().double(), b.detach().double()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if (fa != fb).any():
        return float("inf")
    num = (a - b)[fa].norm()
    den = b[fb].norm()
    if den == 0:
        return float(num)  # both should be zero; any difference counts at absolute scale
    return float(num / den)


def assert_close_sum(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                     msg: str = "") -> None:
    """For results that are sums over many rows (weight grads of a GEMM or a norm): the relative
    Frobenius error of each slice along dim 0 (each expert, for stacked weights) within the dtype's
    rtol, the criterion patch verification applies to gradients.

    Why not elementwise: a sum's rounding error scales with its partial sums, not with its final
    value. Measured on the CPU (torch 2.13, `_grouped_mm`), MoE weight grads over 512 rows per
    expert in fp32 against fp64: rel-norm error 5.8e-7 (30x inside rtol 2e-5), yet 0.09% of the
    elements, those near zero (|ref| ~ 0.01-0.03) whose partial sums reached ~86, miss
    atol 1e-5 + rtol|ref| by up to 3.4x."""
    limit = tol(dtype or actual.dtype).rtol
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    slices = zip(actual, expected) if actual.dim() > 1 else [(actual, expected)]
    for i, (a, b) in enumerate(slices):
        e = rel_norm(a, b)
        assert e <= limit, f"{msg}[{i}]: rel-norm error {e:.3g} > {limit:g}"


# --------------------------------------------------------------------------------------------
# Row/launch helpers shared by the kernel modules
# --------------------------------------------------------------------------------------------


def require_triton(t: torch.Tensor, op: str) -> None:
    """For launchers that have no fallback: raise unless the Triton kernel can run on `t`."""
    if not use_triton(t):
        raise KprofError(
            f"{op}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors); got a tensor on {t.device}. "
            "Call the public function instead, which falls back to the PyTorch reference."
        )


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A 2-D (rows, n_cols) view of t with unit column stride; copies only if none exists
    (e.g. a transposed input). Row strides may be anything (halves of a packed tensor, stride-0
    broadcast rows)."""
    try:
        v = t.view(-1, n_cols)
    except RuntimeError:  # leading dims not collapsible into one row index without a copy
        v = t.reshape(-1, n_cols).contiguous()
    if v.stride(1) != 1 and n_cols > 1:
        v = v.contiguous()
    return v


def rows_and_stride(t: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int]:
    """(t addressable as rows of n_cols with unit column stride, its row stride). A contiguous
    tensor is passed as it is (the kernels only take its data pointer): on the eager hot path an
    aten op is ~12 us of host time on the H200 machine, a launch ~24 us."""
    if t.is_contiguous():
        return t, n_cols
    v = as_rows(t, n_cols)
    return v, v.stride(0)


def new_out(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous tensor of t's shape, on t's device, in `dtype` (default t's): a kernel's
    output. empty_like, not torch.empty(t.shape, dtype=, device=): 2.2 us against 4.9 us (its
    size argument's parsing) on the dev CPU, per output of every eager call. Other allocations
    on the eager path pass their sizes as ints, not a tuple or torch.Size: 2.5 against 5.1 us
    for `torch.empty(x.shape[:-1], ...)`, 2.7 against 3.5 us for 2-D (medians of 15 x 3000)."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


def rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of a tensor of `shape` read as rows of its last dim (cost models)."""
    return math.prod(int(s) for s in shape[:-1]), (int(shape[-1]) if len(shape) else 1)


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def row_tile(n_cols: int, tile_elems: int, max_rows: int = 64) -> tuple[int, int]:
    """(rows, block_n) of a block that holds whole rows: block_n is the row padded to a power of
    2, and short rows are stacked so a block holds about `tile_elems` elements."""
    block_n = next_power_of_2(max(n_cols, 1))
    return max(1, min(max_rows, tile_elems // block_n)), block_n


def num_warps(elems: int, per_thread: int = 16, max_warps: int = 16) -> int:
    """Warps for a block of `elems` elements at about `per_thread` elements a thread (16: two
    16-byte bf16 vectors), at least 4 and at most `max_warps`."""
    return max(4, min(max_warps, elems // (32 * per_thread)))


# The interpreter (CPU CI) has no SMs; 4 "SMs" give persistent grids several programs there, so
# the cross-program reductions (weight-grad partials) are exercised.
INTERPRETER_SM_COUNT = 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SM_COUNT


def persistent_programs(n_work: int, device: torch.device, per_sm: int, n_col_blocks: int = 1) -> int:
    """Programs of a persistent grid: about `per_sm` per SM (shared out over `n_col_blocks`
    column blocks), at most one per work item, at least 1."""
    return max(1, min(n_work, cdiv(sm_count(device) * per_sm, n_col_blocks)))


_NO_CTX = contextlib.nullcontext()


def device_ctx(t: torch.Tensor):
    """Launch on t's GPU (Triton launches on the current device). Switching devices only when
    t is not on the current one: the common single-GPU call skips torch.cuda.device's
    enter/exit (two device exchanges)."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _NO_CTX


@dataclass(frozen=True)
class StreamConfig:
    """Tile shape and warps for the elementwise streaming kernels (glu, bias_gelu)."""

    block_m: int
    block_n: int
    num_warps: int

    # 4096 elements per program: at 8 warps that is 16 elements per thread per tensor, i.e. two
    # 16-byte vector accesses for bf16 (four for fp32), enough bytes in flight per SM to stream
    # (inductor's pointwise kernels use 1024-2048 per program at 4-8 warps). On the H200 SwiGLU
    # fwd at 8192x11008 bf16 ran 125 us of kernel time against the 127 us copy floor.
    TILE = 4096
    # CUDA's limit on grid y; a launch with more row blocks has each program walk several.
    MAX_GRID_Y = 65535

    @classmethod
    @functools.lru_cache(maxsize=1024)  # per call otherwise: ~10 us of Python on the H200 host
    def streaming(cls, n_rows: int, n_cols: int, tile: int | None = None) -> "StreamConfig":
        """A [block_m, block_n] tile of about `tile` (default TILE) elements; wide rows are split
        into column blocks (so any row length works), narrow rows are stacked so a program still
        moves `tile` elements."""
        tile = tile or cls.TILE
        block_n = min(next_power_of_2(max(n_cols, 1)), tile)
        if n_rows > 1 and n_cols > tile:
            # Rows wider than a tile: take the column block (>= tile / 8) that wastes the fewest
            # masked lanes on the row's last block, largest on ties. I = 11008 at a 4096 tile:
            # 4096 pads to 12288 (90% useful), 1024 pads to 11264 (98%) -> 4 rows x 1024.
            block_n = min((tile >> k for k in range(4)), key=lambda b: (cdiv(n_cols, b) * b, -b))
        block_m = min(max(tile // block_n, 1), next_power_of_2(max(n_rows, 1)))
        return cls(block_m, block_n, 8 if block_m * block_n >= 4096 else 4)

    def grid(self, n_rows: int, n_cols: int) -> tuple[int, int]:
        """(column blocks, row blocks): see `stream_tile`."""
        return (cdiv(n_cols, self.block_n), min(cdiv(n_rows, self.block_m), self.MAX_GRID_Y))


@functools.lru_cache(maxsize=1024)
def stream_plan(n_rows: int, n_cols: int, tile: int | None = None) -> tuple[tuple[int, int], int, int, int]:
    """(grid, block_m, block_n, num_warps) for a streaming launch of about `tile` elements per
    program (default StreamConfig.TILE), cached on the ints."""
    cfg = StreamConfig.streaming(n_rows, n_cols, tile)
    return cfg.grid(n_rows, n_cols), cfg.block_m, cfg.block_n, cfg.num_warps


# Device helpers of the streaming kernels (glu, bias_gelu), for tiles laid out by StreamConfig.


@triton.jit
def cast_rtne(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """fp32 -> `dtype` rounding to nearest even, as `.to` does on the GPU.

    Triton's interpreter (3.9) truncates fp32 -> bf16 (it ignores the rounding mode), so CPU
    results would differ from the GPU's by up to one bf16 ulp and never match torch bitwise.
    Under the interpreter (EMULATE_RTNE) the rounding is done on the bits first: add
    0x7FFF + the lowest kept bit, clear the 16 dropped bits; NaNs pass through unchanged.
    Compiled kernels take the plain `.to` (EMULATE_RTNE is False there, so no extra work).
    """
    if EMULATE_RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def acc_zeros(BLOCK_N: tl.constexpr, ACC_F64: tl.constexpr):
    """A zero row of weight-grad partials in fp64 (fp32 inputs) or fp32 (half inputs); rms_norm and layer_norm."""
    if ACC_F64:
        z = tl.zeros([BLOCK_N], dtype=tl.float64)
    else:
        z = tl.zeros([BLOCK_N], dtype=tl.float32)
    return z


@triton.jit
def stream_tile(pid_m, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column indices (int64, so offsets past 2^31 elements are safe) of the
    [BLOCK_M, BLOCK_N] tile in row block `pid_m` and column block program_id(0), and the
    in-bounds mask. The grid is (column blocks, row blocks <= 65535) (`StreamConfig.grid`) and
    the kernels loop over row blocks in strides of the grid's rows (once, below 65535 of them).
    A 2-D grid, not a 1-D one split by `pid // n_col_blocks`: that runtime integer division is
    ~30 SASS instructions (sm_90a), 16-19 per program of the issue-bound bias_gelu forward."""
    rows = tl.arange(0, BLOCK_M).to(tl.int64) + pid_m * BLOCK_M  # pid_m * BLOCK_M < n_rows: no int32 overflow
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows, cols, mask


@triton.jit
def load_f32(ptrs, mask, EVEN: tl.constexpr, FAST: tl.constexpr):
    """Load as fp32; EVEN (every tile full): no mask, so no compare and predicate per element.
    FAST: bf16 converted by `to_f32_fast` (2 instructions per pair of elements instead of 3)."""
    if EVEN:
        return to_f32_fast(tl.load(ptrs), FAST)
    else:
        return to_f32_fast(tl.load(ptrs, mask=mask, other=0.0), FAST)


@triton.jit
def store_cast(ptrs, value, mask, EVEN: tl.constexpr):
    """Store `value` cast to the pointers' dtype; EVEN: unmasked, as `load_f32`."""
    if EVEN:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)

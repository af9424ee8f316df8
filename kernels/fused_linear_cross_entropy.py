"""Fused linear + cross-entropy (the LM head and its loss) without materializing [N, V] logits.

HF computes `logits = hidden @ W.T` ([8192, 128256] bf16 = 2.1 GB), upcasts them to fp32
(4.2 GB) and runs cross-entropy; the backward keeps all of it alive. Here tokens are processed
in chunks of C rows; per chunk, everything happens in the forward:

    logits_c  = h_c @ W.T (+ b)          cuBLAS, input dtype, into one reused [C, V] buffer
    dlogits_c = CE grad, written in place into logits_c by kprof's fused CE kernel
    grad_h_c  = dlogits_c @ W            cuBLAS, written straight into grad_h[c]
    grad_W   += dlogits_c.T @ h_c        cuBLAS addmm (beta=1) into the grad_W buffer
    grad_b   += dlogits_c.sum(0)         fp32

and the backward only scales the stored grads by grad_output (skipped on the device when it is
1, see `cross_entropy`). reduction='none' cannot do that (grad_output differs per token), so it
stores nothing in the forward and recomputes the chunk logits in the backward instead.

Why: at N=8192, H=4096, V=128256 bf16 the 3 GEMMs are 25.8 TFLOP (~34 ms at the ~750 TFLOP/s
large cuBLAS GEMMs reach on an H200) and the CE kernel moves 4.2 GB (~1 ms), while HF's logits
take 2.1 GB + 4.2 GB fp32. Chunking keeps one [C, V] buffer (131 MB at C = 512); the grad_W
update streams grad_W once per chunk, memory-bound below C ~ 412, so C trades memory for speed.
Measured on the H200: fwd+bwd 43.2 ms at C = 512 for 1.25 GB extra, against torch.compile's
39.1-40.1 ms / 3070 MiB and Liger's 55.6-56.0 ms / 1129 MiB (`chunk_rows`). grad_W is
accumulated in the weight's dtype by default (each chunk's GEMM accumulates in fp32 and rounds
once into grad_W: N/C roundings, ~3x eager's error at 16 chunks in bf16, measured on the CPU);
`accum_dtype=torch.float32` matches eager for 4 B per weight element more ([V, H] fp32 = 2.1 GB
here) and twice the update traffic (so its chunk is 1024 rows).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kprof.errors import KprofError
from kprof.kernels.common import kernel_op, use_triton, via_custom_op, warn_fallback
from kprof.kernels.cross_entropy import (
    _DTYPES,
    _FWD_FLOPS_PER_LOGIT,
    _ce_bwd_eager,
    _ce_fwd_launch,
    _check_options,
    _check_target_values,
    _finish,
    _scale_and_count,
    cross_entropy_reference,
)
from kprof.kernels.registry import Cost, KernelSpec, register

# ----------------------------------------------------------------------------------------------
# Chunk size (the one tuning knob besides the CE kernel's own CEConfig)
# ----------------------------------------------------------------------------------------------

# Rows per chunk. The chunk buffer ([C, V] in the input dtype) is the memory this kernel adds
# beyond the grads it must return, and the grad_W update streams all of grad_W once per chunk
# (2 x V x H x 2 B), so C trades memory for speed. H200, N=8192, H=4096, V=128256, bf16, fwd+bwd
# (`python -m benchmarks.cases.loss`):
#     C =  256:  52.6 ms, 1.22 GB extra (Liger's memory)
#     C =  512:  43.2 ms, 1.25 GB       C = 1024: 40.9 ms, 1.38 GB
#     C = 2048:  38.9 ms, 1.64 GB       torch.compile 39.1-40.1 ms / 3070 MiB
# The default, 512 rows, is the smallest chunk whose grad_W update stays compute-bound (2C FLOPs
# per 4 B of grad_W traffic >= the ~206 FLOP/B ridge): 22% faster than Liger for 63 MiB more.
# With an fp32 accumulator the update moves twice the bytes, so twice the rows.
_GEMM_ROWS_BY_ACC_BYTES = {2: 512, 4: 1024}
# Never let the chunk buffer take more than this share of the free device memory.
_FREE_MEMORY_SHARE = 8


def chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype, acc_dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk: enough for a compute-bound grad_W update, capped by free memory and N."""
    rows = _GEMM_ROWS_BY_ACC_BYTES[acc_dtype.itemsize]
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        rows = min(rows, free // (_FREE_MEMORY_SHARE * vocab * dtype.itemsize))
    return int(max(1, min(n_rows, rows)))


# ----------------------------------------------------------------------------------------------
# Host launcher: the chunk loop (GEMMs through torch/cuBLAS, the CE through kprof's kernel)
# ----------------------------------------------------------------------------------------------


def _acc_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc (+)= a @ b where acc may be fp32 and a, b half precision."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif acc.is_cuda:
        # cuBLAS with fp32 output from bf16/fp16 inputs (aten's out_dtype overloads, CUDA only).
        if first:
            torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=acc)
        else:
            torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    else:
        if first:
            torch.mm(a.float(), b.float(), out=acc)
        else:
            acc.addmm_(a.float(), b.float())


def _lce_launch(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    target: torch.Tensor,  # [N]
    grad_scale: torch.Tensor,  # fp32, one value or [N]
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    need_gh: bool,
    need_gw: bool,
    need_gb: bool,
    chunk_size: int,
    accum_fp32: bool,
    gh_into_hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """gh_into_hidden: write grad_hidden over hidden, chunk by chunk, each chunk's rows after
    their last read (the grad_W update); hidden must be contiguous (`linear_cross_entropy`'s
    grad_into_hidden)."""
    n, _ = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    loss_rows = torch.empty(n, dtype=torch.float32, device=dev)
    acc_dtype = torch.float32 if accum_fp32 else weight.dtype
    gh = (hidden if gh_into_hidden else torch.empty_like(hidden)) if need_gh else None
    gw = torch.empty(weight.shape, dtype=acc_dtype, device=dev) if need_gw else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=dev) if need_gb else None
    if n == 0:
        if gw is not None:
            gw.zero_()  # no tokens: grad_W = 0 (the loop below never writes it)
    else:
        _check_target_values(target, vocab, ignore_index)
    any_grad = need_gh or need_gw or need_gb
    c = chunk_size if chunk_size > 0 else chunk_rows(n, vocab, hidden.dtype, acc_dtype, dev)
    buf = torch.empty((min(c, n), vocab), dtype=hidden.dtype, device=dev)  # reused by every chunk
    per_row_scale = grad_scale.numel() != 1
    wt = weight.t()
    for i, c0 in enumerate(range(0, n, c)):
        c1 = min(c0 + c, n)
        h_c = hidden[c0:c1]
        logits = buf[: c1 - c0]  # [C, V]
        if bias is None:
            torch.mm(h_c, wt, out=logits)
        else:
            torch.addmm(bias, h_c, wt, out=logits)
        scale = grad_scale[c0:c1] if per_row_scale else grad_scale
        _ce_fwd_launch(
            logits, target[c0:c1], logits if any_grad else None, loss_rows[c0:c1], scale,
            ignore_index, label_smoothing, z_loss, softcap, check_targets=False,
        )
        # `logits` now holds d loss / d logits for the chunk. grad_W first: it is the last read
        # of h_c, which gh_into_hidden then overwrites.
        if gw is not None:
            _acc_mm(gw, logits.t(), h_c, first=i == 0)  # [V, C] @ [C, H]
        if gh is not None:
            torch.mm(logits, weight, out=gh[c0:c1])  # [C, V] @ [V, H]
        if gb is not None:
            gb += logits.sum(0, dtype=torch.float32)
    if gw is not None and gw.dtype != weight.dtype:
        gw = gw.to(weight.dtype)
    if gb is not None:
        gb = gb.to(bias.dtype)
    return loss_rows, gh, gw, gb


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


# ----------------------------------------------------------------------------------------------
# Registered ops (common.kernel_op). The op is the whole chunk loop, not one op per chunk: under
# torch.compile Dynamo keeps one node whatever the chunk count (its fake is shapes only), and
# AOTAutograd traces the body (for a static token count, see `_symbolic_rows`) into the chunks'
# aten matmuls (which Inductor hands to cuBLAS or its own GEMM templates) and
# `triton_kernel_wrapper_functional` launches of the CE kernel, which Inductor launches itself. In
# eager mode the autograd.Function calls `_lce_launch` directly.
# ----------------------------------------------------------------------------------------------


def _symbolic_rows(hidden: torch.Tensor) -> bool:
    """Whether the op body is being traced with a symbolic token count (torch.compile's dynamic
    shapes, automatic from a second batch shape on). Tracing the chunk loop (N / C iterations)
    would pin N (AOTAutograd adds the guard N == n), so each new token count would compile again
    until Dynamo's recompile limit (8) leaves the frame to run eagerly. The body then calls itself
    as an opaque op instead: one node for any N, which Inductor calls through the dispatcher (the
    CE kernels then launch from Python, as in eager mode)."""
    return isinstance(hidden.shape[0], torch.SymInt)


def _lce_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    need_gh: bool,
    need_gw: bool,
    need_gb: bool,
    chunk_size: int,
    accum_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row fp32 losses [N] and, as requested, grad_hidden, grad_weight, grad_bias (scaled by
    grad_scale; empty [0] tensors for the ones not requested)."""
    if _symbolic_rows(hidden):
        return torch.ops.kprof.linear_cross_entropy_fwd_dynamic(
            hidden, weight, bias, target, grad_scale, ignore_index, label_smoothing, z_loss, softcap,
            need_gh, need_gw, need_gb, chunk_size, accum_fp32,
        )
    loss_rows, gh, gw, gb = _lce_launch(
        hidden, weight, bias, target, grad_scale, ignore_index, label_smoothing, z_loss, softcap,
        need_gh, need_gw, need_gb, chunk_size, accum_fp32,
    )
    return loss_rows, _or_empty(gh, hidden), _or_empty(gw, weight), _or_empty(gb, weight)


# Shapes-only fakes: Dynamo runs these instead of the bodies (which check target values and size
# their chunks from free memory).
def _lce_fwd_fake(hidden, weight, bias, target, grad_scale, ignore_index, label_smoothing, z_loss, softcap,
                  need_gh, need_gw, need_gb, chunk_size, accum_fp32):
    return (
        hidden.new_empty(hidden.shape[0], dtype=torch.float32),
        hidden.new_empty(hidden.shape) if need_gh else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_gw else weight.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_gb else weight.new_empty(0),
    )


def _lce_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    grad_rows: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    need_gh: bool,
    need_gw: bool,
    need_gb: bool,
    chunk_size: int,
    accum_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction='none' backward: recompute the chunk logits and the grads, token t's scaled by
    grad_rows[t]."""
    if _symbolic_rows(hidden):
        return torch.ops.kprof.linear_cross_entropy_bwd_dynamic(
            hidden, weight, bias, target, grad_rows, ignore_index, label_smoothing, z_loss, softcap,
            need_gh, need_gw, need_gb, chunk_size, accum_fp32,
        )
    _, gh, gw, gb = _lce_launch(
        hidden, weight, bias, target, grad_rows.to(torch.float32).contiguous(), ignore_index,
        label_smoothing, z_loss, softcap, need_gh, need_gw, need_gb, chunk_size, accum_fp32,
    )
    return _or_empty(gh, hidden), _or_empty(gw, weight), _or_empty(gb, weight)


def _lce_bwd_fake(hidden, weight, bias, target, grad_rows, ignore_index, label_smoothing, z_loss, softcap,
                  need_gh, need_gw, need_gb, chunk_size, accum_fp32):
    return (
        hidden.new_empty(hidden.shape) if need_gh else hidden.new_empty(0),
        weight.new_empty(weight.shape) if need_gw else weight.new_empty(0),
        weight.new_empty(weight.shape[0]) if need_gb else weight.new_empty(0),
    )


kernel_op("kprof::linear_cross_entropy_fwd")(_lce_fwd).register_fake(_lce_fwd_fake)
kernel_op("kprof::linear_cross_entropy_bwd")(_lce_bwd).register_fake(_lce_bwd_fake)
# The bodies as opaque ops, for a symbolic token count (`_symbolic_rows`).
torch.library.custom_op("kprof::linear_cross_entropy_fwd_dynamic", _lce_fwd, mutates_args=()).register_fake(
    _lce_fwd_fake)
torch.library.custom_op("kprof::linear_cross_entropy_bwd_dynamic", _lce_bwd, mutates_args=()).register_fake(
    _lce_bwd_fake)


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, label_smoothing, reduction, z_loss, softcap,
                chunk_size, accum_fp32, need_gh, need_gw, need_gb, grad_into_hidden, loss_dtype):
        opts = (int(ignore_index), float(label_smoothing), float(z_loss), float(softcap or 0.0))
        ctx.reduction = reduction
        ctx.opts = opts
        ctx.chunk = (chunk_size, accum_fp32)
        ctx.has_bias = bias is not None
        n_valid = None
        # Eager: `_lce_launch` itself, no op dispatch (common.via_custom_op); it returns None for
        # the grads not requested where the op returns empty tensors.
        op = via_custom_op()
        fwd = torch.ops.kprof.linear_cross_entropy_fwd if op else _lce_launch
        if reduction == "none":
            # Per-token grad_output is only known in the backward: store inputs, recompute there.
            ones = torch.ones((), dtype=torch.float32, device=hidden.device)
            loss_rows, *_ = fwd(hidden, weight, bias, target, ones, *opts, False, False, False, chunk_size, accum_fp32)
            ctx.save_for_backward(hidden, weight, bias, target)
        else:
            scale, n_valid = _scale_and_count(target, ignore_index, reduction)
            if grad_into_hidden and need_gh and hidden.is_contiguous() and not op:
                # Eager only (the op is functional). hidden's version counter moves (the GEMMs
                # write it with out=), so anything else that saved hidden fails loudly in its
                # backward, and apply's first-call verification reverts the patch.
                loss_rows, gh, gw, gb = _lce_launch(
                    hidden, weight, bias, target, scale, *opts, need_gh, need_gw, need_gb, chunk_size, accum_fp32,
                    gh_into_hidden=True,
                )
                gh = gh.detach()
            else:
                loss_rows, gh, gw, gb = fwd(
                    hidden, weight, bias, target, scale, *opts, need_gh, need_gw, need_gb, chunk_size, accum_fp32
                )
            ctx.save_for_backward(gh, gw, gb)
            ctx.need = (need_gh, need_gw, need_gb)
        return _finish(loss_rows, target, ignore_index, reduction, n_valid, loss_dtype or hidden.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        tail = (None,) * 13
        if ctx.reduction == "none":
            hidden, weight, bias, target = ctx.saved_tensors
            need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            need_gb = ctx.has_bias and ctx.needs_input_grad[2]
            bwd = torch.ops.kprof.linear_cross_entropy_bwd if via_custom_op() else _lce_bwd
            gh, gw, gb = bwd(
                hidden, weight, bias, target, grad_output, *ctx.opts, need_gh, need_gw, need_gb, *ctx.chunk
            )
        else:
            # Grads were computed in the forward; scale them in place by grad_output (a no-op on
            # the device when it is 1). The buffers are private; a second backward raises.
            gh, gw, gb = ctx.saved_tensors
            need_gh, need_gw, need_gb = ctx.need
            scale = torch.ops.kprof.cross_entropy_bwd if via_custom_op() else _ce_bwd_eager
            for g, need in ((gh, need_gh), (gw, need_gw), (gb, need_gb)):
                if need:
                    scale(g, grad_output)
        return (gh if need_gh else None, gw if need_gw else None, gb if need_gb else None) + tail


# ----------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------


def _check_inputs(hidden, weight, target, bias, chunk_size, accum_dtype) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise KprofError(
            f"linear_cross_entropy expects hidden [..., H] and weight [V, H] (the lm_head weight); "
            f"got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:-1]:
        raise KprofError(
            f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}"
        )
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise KprofError(
            f"hidden and weight must share one dtype in fp32/fp16/bf16; got {hidden.dtype} and {weight.dtype} "
            "(under autocast, cast them explicitly)"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise KprofError(f"target must hold integer class indices (int64 or int32), got {target.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype):
        raise KprofError(
            f"bias must be [V] = [{weight.shape[0]}] in {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    devs = {hidden.device, weight.device, target.device} | ({bias.device} if bias is not None else set())
    if len(devs) > 1:
        raise KprofError(f"inputs are on different devices {sorted(map(str, devs))}; move them to one device")
    if weight.shape[0] == 0:
        raise KprofError("linear_cross_entropy got a weight with 0 rows (V == 0)")
    if chunk_size is not None and chunk_size < 1:
        raise KprofError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise KprofError(f"accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype}")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    accum_dtype: torch.dtype | None = None,
    grad_into_hidden: bool = False,
    loss_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of `F.linear(hidden, weight, bias)` against `target`, without ever holding
    the [N, V] logits: hidden [..., H], weight [V, H], bias [V] or None (fp32/fp16/bf16, one
    dtype), target [...] int64/int32.

    Matches `cross_entropy(F.linear(hidden, weight, bias).view(-1, V), target.view(-1), ...)`
    (the HF LM head: logits in the input dtype, loss in fp32, returned in the input dtype); the
    options are `cross_entropy`'s. reduction='none' returns a loss shaped like `target`.

    chunk_size: tokens per chunk (default `chunk_rows`: 512, 1024 with an fp32 accumulator, fewer
        if memory is short). The extra memory is one [chunk_size, V] buffer in the input dtype:
        256 uses Liger's memory, 2048 is ~5% faster than 512 for 0.4 GB more (measured, H200).
    accum_dtype: dtype grad_weight is accumulated in across chunks: None = the weight's dtype
        (default; Liger's memory), torch.float32 = more accurate, +4 B per weight element.

    loss_dtype: the returned loss's dtype; None = the input dtype (Liger's). torch.float32 returns
        the fp32 sum unrounded, as eager code that upcasts the logits does: a bf16 loss near 12
        is only known to +-0.03, which hid a planted 3% drift from apply's loss watch (H200).

    grad_into_hidden: for 'mean'/'sum' in eager mode, write d loss / d hidden over hidden's own
        (contiguous) storage during the forward instead of a new [N, H] buffer: one [N, H] less
        at the step's memory peak (32 MiB on the 1B Llama, which decided its peak against
        Liger's on the H200). Only for a hidden that nothing reads after this call (the
        final norm's output in a training step); another saved use of it fails loudly in the
        backward (version counter). Ignored under torch.compile and while a profiler records.

    Works with a weight tied to the input embedding (autograd adds both grads). For 'mean' and
    'sum', all grads are computed in the forward (when inputs require grad) and the backward only
    scales them; it can run once (no retain_graph double backward).
    """
    _check_options(label_smoothing, reduction, z_loss, softcap)
    _check_inputs(hidden, weight, target, bias, chunk_size, accum_dtype)
    if not use_triton(hidden):
        warn_fallback("fused_linear_cross_entropy", f"no Triton on {hidden.device} (set TRITON_INTERPRET=1 for CPU)")
        return linear_cross_entropy_reference(
            hidden, weight, target, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
            reduction=reduction, z_loss=z_loss, softcap=softcap,
        )
    lead_shape = target.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = target.reshape(-1)
    grad_on = torch.is_grad_enabled()
    need_gh = grad_on and hidden.requires_grad
    need_gw = grad_on and weight.requires_grad
    need_gb = grad_on and bias is not None and bias.requires_grad
    accum_fp32 = accum_dtype == torch.float32 and weight.dtype != torch.float32
    loss = _LinearCrossEntropyFunction.apply(
        h2, weight, bias, t1, ignore_index, label_smoothing, reduction, z_loss, softcap,
        int(chunk_size or 0), accum_fp32, need_gh, need_gw, need_gb,
        # (not while compiling: Dynamo breaks the graph on a data_ptr comparison; the compiled
        # path is functional anyway)
        bool(grad_into_hidden) and not torch.compiler.is_compiling()
        and h2.is_contiguous() and h2.data_ptr() == hidden.data_ptr(),
        loss_dtype,
    )
    return loss.view(lead_shape) if reduction == "none" else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """Loss module over (hidden, lm_head weight, target[, bias]); see `linear_cross_entropy`."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float | None = None, chunk_size: int | None = None,
                 accum_dtype: torch.dtype | None = None):
        super().__init__()
        _check_options(label_smoothing, reduction, z_loss, softcap)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size, self.accum_dtype = z_loss, softcap, chunk_size, accum_dtype

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction=self.reduction, z_loss=self.z_loss, softcap=self.softcap, chunk_size=self.chunk_size,
            accum_dtype=self.accum_dtype,
        )


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,  # accepted for signature parity
    accum_dtype: torch.dtype | None = None,  # accepted for signature parity
) -> torch.Tensor:
    """Pure PyTorch, HF style: full logits in the input dtype, then `cross_entropy_reference`."""
    logits = F.linear(hidden, weight, bias)
    loss = cross_entropy_reference(
        logits.reshape(-1, weight.shape[0]), target.reshape(-1), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction, z_loss=z_loss, softcap=softcap,
    )
    return loss.view(target.shape) if reduction == "none" else loss


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def _lce_cost(n_rows: int, hidden: int, vocab: int, dtype: torch.dtype = torch.bfloat16,
              bias: bool = False, target_dtype: torch.dtype = torch.int64) -> dict:
    e = dtype.itemsize
    nh, vh, nv = n_rows * hidden, vocab * hidden, n_rows * vocab
    # Forward does everything: 3 GEMMs (logits, grad_h, grad_W) + the CE kernel.
    flops = 3 * 2 * n_rows * hidden * vocab + _FWD_FLOPS_PER_LOGIT * nv + (nv if bias else 0)
    # Minimal bytes: read hidden, weight (+ bias, target) once; write grad_h, grad_W (+ grad_b).
    # The chunk logits round trip (4 N V bytes: GEMM write, CE read + write, two GEMM reads) is
    # real traffic, but not a minimum: a fused GEMM epilogue would avoid it.
    fwd_bytes = 2 * (nh + vh) * e + n_rows * target_dtype.itemsize + 4 * n_rows + (2 * vocab * e if bias else 0)
    # Backward: minimal cost zero (grad_output == 1 skips the scaling on the device); otherwise it
    # reads and writes grad_h and grad_W once: 2 * (nh + vh) * e bytes.
    return {"fwd": Cost(flops=flops, bytes=fwd_bytes), "bwd": Cost(flops=0.0, bytes=0.0)}


def _op_cost(metas) -> Cost:
    hidden, weight = metas[0], metas[1]
    n = math.prod(hidden.shape[:-1])
    return _lce_cost(n, hidden.shape[-1], weight.shape[0], hidden.dtype)["fwd"]


SPEC = register(
    KernelSpec(
        name="fused_linear_cross_entropy",
        replaces="lm_head = F.linear(hidden, W) + F.cross_entropy(logits.float(), target) and their backward",
        dtypes=_DTYPES,
        limits=(
            "hidden [..., H], weight [V, H], V < 2^31; chunks of 512 tokens (1024 with fp32 accumulation) "
            "or fewer when memory is short; no class weights"
        ),
        deterministic=True,  # fixed chunk order, cuBLAS on one stream, CE kernel without atomics
        fn=linear_cross_entropy,
        module=LinearCrossEntropyLoss,
        reference=linear_cross_entropy_reference,
        cost=_lce_cost,
        op_costs={
            # Listed for the training case (grads requested): 3 GEMMs. Called without grads (eval,
            # or the forward of reduction='none') the op does 1 GEMM.
            "kprof::linear_cross_entropy_fwd": _op_cost,
            "kprof::linear_cross_entropy_bwd": _op_cost,
            "kprof::linear_cross_entropy_fwd_dynamic": _op_cost,
            "kprof::linear_cross_entropy_bwd_dynamic": _op_cost,
        },
    )
)

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "LinearCrossEntropyLoss", "chunk_rows"]

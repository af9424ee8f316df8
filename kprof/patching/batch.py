"""The largest batch that fits, found by trying it (`kprof apply --prefer memory`, issue 28).

At the end of the ablation run, with the script's weights, gradients and optimizer state still
live, the model's latest input is repeated along its batch dimension and run forward and
backward at growing batch sizes until the device runs out of memory: once with every verified
patch off, once with every one on. Doubling finds the first size that fails, then bisection the
largest that fits. Only CUDA has a memory limit to find; on a CPU the search is skipped (the
process would swap, not fail).

The trials leave the script as they found it: its gradients are put back, the RNG state is
restored, and the run stops right after (a trial's forward may have moved BatchNorm statistics).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

MAX_FACTOR = 64  # the search stops at 64x the script's batch: enough to show headroom, bounded time
CPU_SKIPPED = ("largest batch: not measured on a CPU (no device memory limit to run into; the "
               "process would swap); run kprof apply --prefer memory on the GPU")


def search(fits: Callable[[int], bool], start: int, limit: int) -> int | None:
    """The largest b in [start, limit] with fits(b) (fits is monotone: what fits, fits smaller),
    or None when `start` itself does not fit. Doubling, then bisection."""
    if start < 1 or not fits(start):
        return None
    good, bad = start, None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def batch_of(args: tuple, kwargs: dict) -> int | None:
    """The batch size of a call: dim 0 of its first tensor argument."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def _resized(args: tuple, kwargs: dict, n: int, b: int):
    """Every tensor whose dim 0 is the batch `n`, repeated (and cut) to `b` rows."""
    def one(t):
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != n:
            return t
        reps = -(-b // n)
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:b]

    return pytree.tree_map(one, (args, kwargs))


def _loss(out: Any) -> torch.Tensor | None:
    if hasattr(out, "to_tuple"):  # transformers ModelOutput: its loss comes first when present
        out = out.to_tuple()
    ts = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
          and t.is_floating_point()]
    scalar = next((t for t in ts if t.dim() == 0), None)
    if scalar is not None:
        return scalar
    return sum(t.float().sum() for t in ts) if ts else None


def trial(model: nn.Module, args: tuple, kwargs: dict) -> Callable[[int], bool]:
    """fits(b): one forward and backward of `model` at batch b, on CUDA; False on out of memory."""
    n = batch_of(args, kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    devices = sorted({p.device.index or 0 for p in params if p.is_cuda})

    def fits(b: int) -> bool:
        a, kw = _resized(args, kwargs, n, b)
        saved = [p.grad for p in params]
        for p in params:  # backward would accumulate into the script's gradients in place
            p.grad = None
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                # forward, not __call__: a script without an optimizer has its steps counted in
                # calls of this outermost module (kprof/capture/runner.py), and a trial is no step
                loss = _loss(model.forward(*a, **kw))
                if loss is not None:
                    loss.backward()
            if torch.cuda.is_initialized():  # an out of memory surfaces here at the latest
                torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            for p, g in zip(params, saved):
                p.grad = g
            del a, kw
            torch.cuda.empty_cache()

    return fits

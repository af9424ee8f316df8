"""What is alive at a CUDA memory peak, and which code allocated it.

    python benchmarks/bench_llama_step.py --variants kprof,liger --memory-peak

Issue 5's memory target is missed by 0.12 GiB on the 1B Llama (kprof 11.15 GiB against Liger's
11.03, H200 2026-11-29); half of it is the fused linear + cross-entropy's chunk buffer, the rest is
not located. The allocator's own event trace answers that: record one training step with
`torch.cuda.memory._record_memory_history`, replay its alloc/free events to find the moment of the
peak, and group the blocks alive then by the first frame of the allocating stack that is not
torch's. `live_at_peak` and `by_site` are pure functions of the snapshot (tested on the CPU with a
synthetic trace); only `record_step` needs a GPU.

Reproduces: benchmarks/results/memory-peak-1b-{eager,kprof,liger}-2026-11-29T2210Z.json, the
figure behind kernels/glu.py's in-place GLU backward (kprof's peak 5.44 GiB above the parameters
in the last MLP's backward against Liger's 5.31) and the top README's 11.03 GiB for both:
    python benchmarks/bench_llama_step.py --variants eager,kprof,liger --memory-peak   (H200)
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Callable

# Frames from these folders are never "the site": the allocation is attributed to the caller.
_SKIP = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py", "<frozen", "<string>")


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay one device's trace (`snapshot["device_traces"][i]`): `alloc` adds a block, its first
    `free_requested`/`free_completed` removes it (a block freed with pending uses on another
    stream is reusable only at `free_completed`, but user code has let go of it at the request).
    Returns (peak bytes above the level at the start of recording, the blocks alive at the peak).
    The peak is the first moment the running total is highest."""
    live: dict[Any, dict] = {}
    total = peak = 0
    peak_set: list[dict] = []
    for ev in trace:
        action, addr = ev.get("action"), ev.get("addr")
        if action == "alloc":
            live[addr] = ev
            total += int(ev.get("size") or 0)
            if total > peak:
                peak, peak_set = total, list(live.values())
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= int(live.pop(addr).get("size") or 0)
    return peak, peak_set


def site(frames: list[dict], skip: tuple[str, ...] = _SKIP) -> str:
    """file:line (function) of the innermost frame outside torch: where user or kprof code asked."""
    for f in frames or []:
        name = str(f.get("filename", ""))
        # C++ frames (filename "??", e.g. torch::unwind::unwind()) never name the site: the first
        # H200 recording (2026-11-29) with the default stacks="all" put every block there.
        if name.endswith(".py") and not any(s in name for s in skip):
            return f"{name}:{f.get('line')} ({f.get('name')})"
    return "<torch internal>"


def by_site(blocks: list[dict], key: Callable[[list[dict]], str] = site, top: int = 20) -> list[dict]:
    """Blocks grouped by allocation site, largest total first: [{site, bytes, blocks}]."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for b in blocks:
        k = key(b.get("frames") or [])
        acc[k][0] += int(b.get("size") or 0)
        acc[k][1] += 1
    rows = [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["bytes"])[:top]


def record_step(step: Callable[[], None], max_entries: int = 500_000) -> dict:
    """Run `step` once with the allocator's history recorded; returns {base_bytes, peak_bytes,
    sites}: memory allocated before the step, the step's peak above it, and the alive blocks at
    the peak by site. CUDA only."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=max_entries)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    dev = torch.cuda.current_device()
    trace = snap["device_traces"][dev] if len(snap.get("device_traces", [])) > dev else []
    peak, blocks = live_at_peak(trace)
    return {"base_bytes": base, "peak_bytes": peak, "sites": by_site(blocks)}

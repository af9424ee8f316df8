"""Replay a CUDA graph for a few seconds while nvidia-smi samples the SM clock, power and the
active clock-throttle reasons every 50 ms; one summary line. Used by the debug_clocks_* scripts
to tell a kernel that is slow from a card that is power-capped (the H200's 700 W, 2026-11-30)."""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sustained(graph: torch.cuda.CUDAGraph, calls: int, seconds: float = 3.0, unit: str = "us") -> str:
    """Replay `graph` (`calls` calls captured back to back) for `seconds`, timing each replay with
    CUDA events; returns per-call time quantiles beside nvidia-smi's clock and power samples."""
    scale = 1e3 if unit == "us" else 1.0  # event times are in ms
    graph.replay()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    times, t_end = [], time.time() + seconds
    while time.time() < t_end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * scale / calls)
    smi.terminate()
    out = smi.communicate()[0]
    rows = [r.split(", ") for r in out.strip().splitlines() if r.count(",") == 3]
    clk = [float(r[0]) for r in rows] or [float("nan")]
    pw = [float(r[1]) for r in rows if r[1].replace(".", "").isdigit()] or [float("nan")]
    reasons = sorted({r[3] for r in rows})
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return (f"per call: median {statistics.median(times):6.1f} {unit}, p10 {q[0]:6.1f}, p90 {q[-1]:6.1f} "
            f"({len(times)} replays); SM clock MHz min/median/max {min(clk):.0f}/{statistics.median(clk):.0f}/{max(clk):.0f}; "
            f"power W median/max {statistics.median(pw):.0f}/{max(pw):.0f}; throttle reasons {reasons}; "
            f"temp {rows[-1][2] if rows else '?'} C")

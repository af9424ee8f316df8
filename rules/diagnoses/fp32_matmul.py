"""fp32 matmuls on a GPU with tensor cores -> TF32 or bf16 autocast.

By default PyTorch runs fp32 matmuls at full fp32 precision on the CUDA cores
(`torch.backends.cuda.matmul.allow_tf32` is False since torch 1.12). From Ampere (sm_80) on,
tensor cores run the same matmul in TF32 (fp32 range, 10-bit mantissa inputs, fp32 accumulate)
at several times the rate: on an H200, fp32 50.5 vs tf32 387 vs bf16 750 TFLOP/s (measured by
`kprof calibrate`, 2026-11-29, see kprof/analyze/ceilings.py). bf16 autocast also halves the bytes.

Evidence: ops.parquet rows with `tensor_core` true, FLOPs counted and `dtype class` fp32, on a
CUDA device of compute capability >= 8.0. Not flagged: CPU runs (no tensor cores), pre-Ampere
GPUs, and runs where TF32 evidently already is on (a kernel named *tf32*, or fp32 matmuls
running faster than the fp32 peak allows; the runner does not record the TF32 flag itself).

Saving: per op, its measured time minus its roofline time at the tf32 peak (max(FLOPs / peak,
bytes / bandwidth) at the run's ceilings, at least one launch latency), never below zero; the bf16 figure is the same with
the bf16 peak and half the bytes.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from kprof.rules import edits
from kprof.rules.diagnoses.base import Diagnosis, Finding, is_gpu_run, n_steps, step_ms

MIN_CAPABILITY = (8, 0)  # TF32 and bf16 tensor cores arrive with Ampere (sm_80), NVIDIA Ampere whitepaper
# fp32 matmuls achieving more than this multiple of the fp32 peak must be running on tensor cores
# already (TF32 on): a calibrated peak is a measured best, 10% covers its run-to-run noise.
TF32_ALREADY_ON = 1.1
# Findings below this share of the step are not reported: under 1% is within the run-to-run
# spread of a step (kprof profile reports the spread; ~1-3% on the H200 runs in benchmarks/results).
MIN_SAVING_PCT = 1.0
TOP_MODULES = 3

HOW = ('torch.backends.cuda.matmul.allow_tf32 = True  (or torch.set_float32_matmul_precision("high")) '
       'once at the top of the script; or run forward+loss under '
       'torch.autocast("cuda", dtype=torch.bfloat16)')


def _capability(summary: dict) -> tuple[int, int] | None:
    cap = (summary.get("device") or {}).get("capability")
    try:
        major, minor = str(cap).split(".")
        return int(major), int(minor)
    except (ValueError, AttributeError):
        return None


def fp32_matmuls(ops: pd.DataFrame) -> pd.DataFrame:
    """Matmul-class rows with counted FLOPs and fp32 inputs, not already on TF32 kernels."""
    need = {"tensor_core", "dtype class", "flops", "device_time (us)"}
    if ops is None or not len(ops) or not need <= set(ops.columns):
        return pd.DataFrame(columns=list(ops.columns) if ops is not None else [])
    flops = pd.to_numeric(ops["flops"], errors="coerce").fillna(0)
    sel = ops["tensor_core"].fillna(False).astype(bool) & (ops["dtype class"] == "fp32") & (flops > 0)
    if "phase" in ops:
        sel &= ops["phase"].isin(["fwd", "bwd"])
    if "kernel" in ops:
        sel &= ~ops["kernel"].astype(str).str.contains("tf32", case=False, na=False)
    return ops[sel]


def time_at_peak_us(flops: np.ndarray, nbytes: np.ndarray, tflops: float, gbs: float) -> np.ndarray:
    """Roofline time per op, vectorized: max(FLOPs / peak, bytes / bandwidth) in us."""
    return np.maximum(flops / (tflops * 1e12), nbytes / (gbs * 1e9)) * 1e6


def find(ops: pd.DataFrame, summary: dict) -> list[Finding]:
    if not is_gpu_run(summary):
        return []
    cap = _capability(summary)
    if cap is None or cap < MIN_CAPABILITY:
        return []
    mm = fp32_matmuls(ops)
    if not len(mm):
        return []
    ceil = summary.get("ceilings") or {}
    peaks = ceil.get("peak_tflops") or {}
    bw = float(ceil.get("mem_bw_gbs") or math.nan)
    n = n_steps(ops, summary)
    t = pd.to_numeric(mm["device_time (us)"], errors="coerce").fillna(0).to_numpy()
    flops = pd.to_numeric(mm["flops"], errors="coerce").fillna(0).to_numpy()
    nbytes = pd.to_numeric(mm.get("bytes"), errors="coerce").fillna(0).to_numpy() if "bytes" in mm else np.zeros(len(mm))
    measured = t.sum() / n / 1e3  # ms/step
    achieved = flops.sum() / (t.sum() * 1e-6) / 1e12 if t.sum() > 0 else math.nan  # TFLOP/s
    fp32_peak = float(peaks.get("fp32") or math.nan)
    if math.isfinite(fp32_peak) and achieved > TF32_ALREADY_ON * fp32_peak:
        return []  # faster than fp32 can go: TF32 is on already

    def saving(cls: str, byte_scale: float) -> float:
        peak = float(peaks.get(cls) or math.nan)
        if not (math.isfinite(peak) and math.isfinite(bw)):
            return math.nan
        # At least one launch latency per op, as suggest's roofline_us: a 3 us matmul of a tiny
        # model is launch-bound and TF32 does not speed it up.
        new = np.maximum(time_at_peak_us(flops, nbytes * byte_scale, peak, bw), float(ceil.get("latency_us") or 0.0))
        return float(np.maximum(t - new, 0).sum()) / n / 1e3

    tf32 = saving("tf32", 1.0)
    bf16 = saving("bf16", 0.5)
    st = step_ms(summary)
    if math.isfinite(tf32) and math.isfinite(st) and st > 0 and tf32 / st * 100 < MIN_SAVING_PCT:
        return []
    from kprof.analyze.modules import group_paths

    by_mod = (mm.assign(_t=t).groupby("module")["_t"].sum().sort_values(ascending=False)
              if "module" in mm else pd.Series(dtype=float))
    paths = list(by_mod.index)
    groups = group_paths(paths) if len(paths) > 1 else [(paths[0], 1)] if paths else []
    where = ", ".join(f"{g} x {k}" if k > 1 else g or "<model>" for g, k in groups[:TOP_MODULES])
    if len(groups) > TOP_MODULES:
        where += f", +{len(groups) - TOP_MODULES} more"
    evidence = (f"{len(mm) / n:g} fp32 matmuls/step, {measured:.2f} ms/step at {achieved:.1f} TFLOP/s "
                f"(fp32 peak {fp32_peak:g}, tf32 {peaks.get('tf32', '?')}, bf16 {peaks.get('bf16', '?')} TFLOP/s)")
    if math.isfinite(bf16):
        evidence += f"\nwith bf16 autocast instead: ~{bf16:.2f} ms/step saved"
    return [Finding(
        where=where,
        evidence=evidence,
        change="run fp32 matmuls on tensor cores: TF32 (10-bit mantissa inputs, fp32 accumulate), or bf16 autocast",
        how=HOW,
        ms_per_step=measured,
        saving_ms=tf32,
        saving_note=("measured fp32 matmul time - roofline time at the tf32 peak (per op, run's ceilings)"
                     if math.isfinite(tf32) else "no tf32 peak or bandwidth in this run's ceilings: run `kprof calibrate`"),
        paths=list(by_mod.index),
        cls="compute-bound",
        # Datasheet peaks overstate what a matmul reaches (H200: tf32 494.5 datasheet vs 387 measured).
        confidence="high" if ceil.get("kind") == "measured" else "medium",
        details=[{"module": m, "ms/step": v / n / 1e3} for m, v in by_mod.items()],
        # TF32 is the one-line change; bf16 autocast wraps the step, which no line-level edit can place.
        diff=edits.tf32(summary.get("script")),
    )]


DIAGNOSIS = Diagnosis(id="fp32_matmul", title="fp32 matmuls on a GPU with tensor cores", find=find)

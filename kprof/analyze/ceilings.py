"""The roofline's ceilings: memory bandwidth, peak FLOP/s per dtype class, and launch latency.

Where they come from, in order (`for_device`):
1. a calibration cached by `kprof calibrate` for this device (`calibrate` measures them);
2. the datasheet table below (dense tensor-core peaks: NVIDIA datasheets quote the "with
   sparsity" numbers, which are 2x the dense ones; the table holds the dense ones);
3. CPU without calibration: a conservative labelled default; an unknown GPU: NaN ceilings and a
   note to run `kprof calibrate` (the roofline then says "unknown" rather than guessing).

`latency_us` is defined by measurement: the duration of the smallest device copy that reaches
half of the measured copy bandwidth (copy sizes doubling from 4 KiB), or the time of the smallest
op (a 1-element add_, back to back) if that is longer. A kernel shorter than that spends most of
its time on fixed costs (launch, ramp-up, tail), not on its bytes or FLOPs, so the roofline does
not describe it: analysis.py calls such ops latency-bound. Datasheets do not give it; their entries use
DEFAULT_GPU_LATENCY_US until calibrated.

Measured on an NVIDIA H200 (torch 2.11, CUDA 13, `kprof calibrate`, 2026-11-29): copy 4161 GB/s;
fp32 50.5, tf32 387, bf16 750, fp16 723, fp8 1227 TFLOP/s; smallest op 10.7 us per call; the
copy sweep stayed at ~9.8-10.1 us per copy from 4 KiB to 2 MiB (0.8 -> 415 GB/s), then 10.5 us
at 4 MiB, 12.0 us at 8 MiB, and reached half bandwidth at 16 MiB (2377 GB/s, 14.1 us), so
latency_us = 14.1. The sweep goes high enough (it stops at the first size reaching half
bandwidth; the full plan allows up to 512 MiB). What it measures at the small end is the host:
copies are timed back to back with CUDA events, and a ~10 us flat floor is the eager launch
interval (the 1-element add_ gives the same 10.7 us), not the copy kernel's own few
microseconds. That is the intended meaning of the threshold: a kernel shorter than the host's
launch interval leaves the GPU waiting for the next launch in an eager loop, and the fix is
fewer launches (fusion, CUDA graphs), not fewer bytes. A device-side-only latency (timing the
sweep inside a CUDA graph) would be lower; not done.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kprof.errors import KprofError

DTYPE_CLASSES = ("fp32", "tf32", "bf16", "fp16", "fp8")

# Until `kprof calibrate` measures it: on H100/A100 a back-to-back kernel costs ~2-3 us and a
# copy needs ~4-8 us to reach half of HBM bandwidth (our H200 calibration is what replaces this).
DEFAULT_GPU_LATENCY_US = 5.0


@dataclass
class Ceilings:
    device: str
    mem_bw_gbs: float  # GB/s (1e9 bytes/s), copy bandwidth counting read + write
    peak_tflops: dict[str, float]  # dense peaks by dtype class: fp32 (CUDA cores), tf32, bf16, fp16, fp8
    latency_us: float  # see the module docstring
    source: str  # "measured by kprof calibrate on <date>" | "datasheet: <doc>" | "default: ..."
    kind: str = "datasheet"  # "measured" | "datasheet" | "default" | "unknown"
    notes: list[str] = field(default_factory=list)

    def peak(self, cls: str) -> float:
        """Peak TFLOP/s for a dtype class, falling back to the nearest one present: tf32 -> fp32,
        fp16 <-> bf16, fp8 -> bf16 (a device without fp8 runs fp8 work no faster than bf16)."""
        for k in {"tf32": ("tf32", "fp32"), "fp16": ("fp16", "bf16", "fp32"), "bf16": ("bf16", "fp16", "fp32"),
                  "fp8": ("fp8", "bf16", "fp16", "fp32")}.get(cls, (cls, "fp32")):
            v = self.peak_tflops.get(k)
            if v:
                return float(v)
        return math.nan

    def ridge(self, cls: str) -> float:
        """FLOP/B at which the compute and memory roofs meet for this dtype class."""
        return self.peak(cls) * 1e12 / (self.mem_bw_gbs * 1e9) if self.mem_bw_gbs else math.nan

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        return cls(device=str(d["device"]), mem_bw_gbs=float(d["mem_bw_gbs"]),
                   peak_tflops={k: float(v) for k, v in (d.get("peak_tflops") or {}).items() if v is not None},
                   latency_us=float(d["latency_us"]), source=str(d["source"]), kind=str(d.get("kind", "measured")),
                   notes=list(d.get("notes") or []))


# ----------------------------------------------------------------------------------------------
# Datasheet table. Order is precedence (first regex that matches the device name wins).
# Columns: name pattern, label, memory GB/s, dense TFLOP/s fp32 / tf32 / bf16 / fp16 / fp8, source.


@dataclass(frozen=True)
class Datasheet:
    pattern: str
    label: str
    mem_bw_gbs: float
    fp32: float
    tf32: float
    bf16: float
    fp16: float
    fp8: float | None
    source: str


_H200 = "NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200), sparsity figures halved"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), sparsity figures halved"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100)"
DATASHEETS: list[Datasheet] = [
    Datasheet(r"H200 NVL", "H200 NVL", 4800, 60, 417.5, 835.5, 835.5, 1670.5, _H200),
    Datasheet(r"H200", "H200 SXM", 4800, 67, 494.5, 989.5, 989.5, 1979, _H200),
    Datasheet(r"H100 NVL", "H100 NVL", 3900, 60, 417.5, 835.5, 835.5, 1670.5, _H100),
    Datasheet(r"H100.*PCIe", "H100 PCIe", 2000, 51, 378, 756, 756, 1513, _H100),
    Datasheet(r"H100", "H100 SXM", 3350, 67, 494.5, 989.5, 989.5, 1979, _H100),
    Datasheet(r"A100.*80GB.*PCIe|A100 80GB PCIe", "A100 PCIe 80GB", 1935, 19.5, 156, 312, 312, None, _A100),
    Datasheet(r"A100.*80GB", "A100 SXM 80GB", 2039, 19.5, 156, 312, 312, None, _A100),
    Datasheet(r"A100", "A100 40GB", 1555, 19.5, 156, 312, 312, None, _A100),
    Datasheet(r"L40S", "L40S", 864, 91.6, 183, 362, 362, 733,
              "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s), sparsity figures halved"),
    Datasheet(r"\bL4\b", "L4", 300, 30.3, 60, 121, 121, 242.5,
              "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4), sparsity figures halved"),
    Datasheet(r"A10G", "A10G", 600, 31.2, 35, 70, 70, None,
              "NVIDIA A10G (AWS G5) spec: 600 GB/s; tensor peaks per the Ampere GA102 whitepaper"),
    Datasheet(r"\bA10\b", "A10", 600, 31.2, 62.5, 125, 125, None,
              "NVIDIA A10 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/products/a10-gpu)"),
    Datasheet(r"RTX 4090", "GeForce RTX 4090", 1008, 82.6, 82.6, 165.2, 165.2, 330.3,
              "NVIDIA Ada GPU architecture whitepaper, Appendix A (FP32-accumulate tensor rates)"),
]


def datasheet_for(name: str) -> Ceilings | None:
    for d in DATASHEETS:
        if re.search(d.pattern, name or ""):
            peaks = {"fp32": d.fp32, "tf32": d.tf32, "bf16": d.bf16, "fp16": d.fp16}
            if d.fp8:
                peaks["fp8"] = d.fp8
            return Ceilings(device=name, mem_bw_gbs=float(d.mem_bw_gbs), peak_tflops=peaks,
                            latency_us=DEFAULT_GPU_LATENCY_US, source=f"datasheet: {d.label}, {d.source}",
                            kind="datasheet",
                            notes=[f"latency_us is kprof's default ({DEFAULT_GPU_LATENCY_US} us) until "
                                   "`kprof calibrate` measures it"])
    return None


# Uncalibrated CPU: low on purpose, so that a CPU profile does not call ops slow against a roof
# the machine does not have. 20 GB/s is below one DDR4-3200 channel (25.6 GB/s); 0.1 TFLOP/s fp32
# is what ~4 AVX2 cores at 3 GHz sustain in a matmul.
CPU_DEFAULT = dict(mem_bw_gbs=20.0, peak_tflops={"fp32": 0.1, "bf16": 0.1}, latency_us=20.0)


# ----------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    root = os.environ.get("KPROF_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kprof"
    return base / "ceilings"


def device_key(device: dict) -> str:
    """File-name key of a device: type, name and (GPU) SM count, so a MIG slice or a different
    SKU with the same name does not share a calibration."""
    parts = [str(device.get("type", "?")), str(device.get("name", "?"))]
    if device.get("sm_count"):
        parts.append(f"sm{device['sm_count']}")
    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(parts)).strip("-").lower()


def cache_path(device: dict) -> Path:
    return cache_dir() / f"{device_key(device)}.json"


def load_cached(device: dict) -> Ceilings | None:
    p = cache_path(device)
    if not p.exists():
        return None
    try:
        return Ceilings.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a corrupt cache falls back to the datasheet; `kprof calibrate` rewrites it


def save(c: Ceilings, device: dict) -> Path:
    p = cache_path(device)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(c), indent=2))
    tmp.replace(p)
    return p


def for_device(device: dict) -> Ceilings:
    """Ceilings for a runner device dict (type, name, sm_count, ...): cache, datasheet, default."""
    device = device or {}
    cached = load_cached(device)
    if cached is not None:
        return cached
    name = str(device.get("name") or "")
    if device.get("type") == "cuda":
        ds = datasheet_for(name)
        if ds is not None:
            return ds
        return Ceilings(device=name or "unknown GPU", mem_bw_gbs=math.nan, peak_tflops={}, latency_us=DEFAULT_GPU_LATENCY_US,
                        source=f"unknown device {name!r}: run `kprof calibrate` to measure its ceilings",
                        kind="unknown", notes=["no datasheet entry and no calibration: roofline columns are empty"])
    return Ceilings(device=name or "cpu", source="default: uncalibrated CPU; run `kprof calibrate` to measure it",
                    kind="default", notes=["conservative CPU default (see kprof/analyze/ceilings.py CPU_DEFAULT)"],
                    **{k: (dict(v) if isinstance(v, dict) else v) for k, v in CPU_DEFAULT.items()})


# ----------------------------------------------------------------------------------------------
# Calibration


@dataclass(frozen=True)
class CalibrationPlan:
    """Sizes and repeats. GPU copy: 2 GiB per buffer (4 GiB moved per copy), far past any L2, as
    the brief asks (>= 2 GB); matmul 8192^3: long enough (~1 ms at bf16 peak) to hide launch."""

    copy_bytes: int
    matmul_n: int
    bf16_matmul_n: int
    repeats: int
    sweep_max_bytes: int

    @classmethod
    def gpu(cls, quick: bool) -> "CalibrationPlan":
        return cls(256 << 20, 4096, 4096, 5, 64 << 20) if quick else cls(2 << 30, 8192, 8192, 20, 512 << 20)

    @classmethod
    def cpu(cls, quick: bool) -> "CalibrationPlan":
        # bf16 matmuls are slow on CPUs without AMX/AVX512-BF16, hence the smaller n.
        return cls(16 << 20, 256, 128, 3, 8 << 20) if quick else cls(128 << 20, 1024, 512, 5, 64 << 20)


class _Timer:
    """Median time of fn() in seconds: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
        fn()  # warm up (allocations, cuBLAS heuristics)
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3 / inner)
        else:
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times.append((time.perf_counter() - t0) / inner)
        return statistics.median(times)


def _copy_bw(timer: _Timer, dev: torch.device, nbytes: int, repeats: int) -> tuple[float, float]:
    """(GB/s counting read + write, seconds per copy) of a device-to-device copy of nbytes."""
    n = max(nbytes // 4, 1)
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    inner = 1 if nbytes >= (64 << 20) else max(1, min(200, (64 << 20) // max(nbytes, 1)))
    t = timer(lambda: dst.copy_(src), repeats, inner)
    return 2 * n * 4 / t / 1e9, t


def _matmul_tflops(timer: _Timer, dev: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = timer(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / t / 1e12


def _fp8_tflops(timer: _Timer, dev: torch.device, n: int, repeats: int) -> float:
    # torch._scaled_mm wants a row-major e4m3 A, a column-major e4m3 B and fp32 scales.
    a = (torch.randn(n, n, device=dev) * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(n, n, device=dev) * 0.5).to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev, dtype=torch.float32)
    t = timer(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), repeats)
    return 2 * n**3 / t / 1e12


def _latency(timer: _Timer, dev: torch.device, peak_gbs: float, max_bytes: int, repeats: int) -> tuple[float, list]:
    """Sweep copy sizes (doubling from 4 KiB) and return the duration (us) of the smallest copy
    that reaches half of peak_gbs, with the sweep points (bytes, GB/s, us)."""
    sweep = []
    nbytes = 4096
    while nbytes <= max_bytes:
        gbs, t = _copy_bw(timer, dev, nbytes, repeats)
        sweep.append((nbytes, round(gbs, 1), round(t * 1e6, 2)))
        if gbs >= 0.5 * peak_gbs:
            return t * 1e6, sweep
        nbytes *= 2
    return sweep[-1][2] if sweep else math.nan, sweep


def _as_torch_device(device: Any) -> tuple[torch.device, dict]:
    if isinstance(device, dict):
        info = dict(device)
        if info.get("type") == "cuda":
            return torch.device("cuda", int(info.get("index") or 0)), info
        return torch.device("cpu"), info
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return dev, {"type": "cuda", "name": props.name, "sm_count": props.multi_processor_count}
    try:  # the runner's description, so the cache key matches the one for_device sees in a run
        from kprof.capture.runner import device_info

        info = device_info()
        if info.get("type") == "cpu":
            return dev, info
    except ImportError:
        pass
    import platform

    return dev, {"type": "cpu", "name": platform.processor() or platform.machine()}


def calibrate(device: Any = None, quick: bool = False, save_cache: bool = True) -> Ceilings:
    """Measure the ceilings of `device` (a runner device dict, "cuda", "cpu" or a torch.device)
    and cache them for `for_device`.

    Bandwidth: median of timed copies (read + write bytes). Matmul peaks: square matmuls on
    random data (never zeros, which some hardware runs faster): fp32 with TF32 off, tf32, bf16,
    fp16, and fp8 through torch._scaled_mm where the device supports it. Latency: see the module
    docstring. `quick` shrinks everything so it runs in seconds (tests, smoke checks)."""
    dev, info = _as_torch_device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KprofError("calibrate: CUDA device requested but torch.cuda.is_available() is False; "
                         "run on the GPU machine or calibrate the CPU")
    timer = _Timer(dev)
    notes: list[str] = []
    if dev.type == "cuda":
        plan = CalibrationPlan.gpu(quick)
        free, _ = torch.cuda.mem_get_info(dev)
        copy_bytes = plan.copy_bytes
        while 2 * copy_bytes > 0.8 * free and copy_bytes > (64 << 20):
            copy_bytes //= 2  # both buffers must fit
        if copy_bytes != plan.copy_bytes:
            notes.append(f"copy buffer reduced to {copy_bytes >> 20} MiB to fit free memory")
        bw, _ = _copy_bw(timer, dev, copy_bytes, plan.repeats)
        peaks: dict[str, float] = {}
        prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        try:
            torch.backends.cuda.matmul.allow_tf32 = False
            peaks["fp32"] = _matmul_tflops(timer, dev, plan.matmul_n, torch.float32, plan.repeats)
            torch.backends.cuda.matmul.allow_tf32 = True
            peaks["tf32"] = _matmul_tflops(timer, dev, plan.matmul_n, torch.float32, plan.repeats)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev
        peaks["bf16"] = _matmul_tflops(timer, dev, plan.bf16_matmul_n, torch.bfloat16, plan.repeats)
        peaks["fp16"] = _matmul_tflops(timer, dev, plan.bf16_matmul_n, torch.float16, plan.repeats)
        if torch.cuda.get_device_capability(dev) >= (8, 9) and hasattr(torch, "_scaled_mm"):
            try:
                peaks["fp8"] = _fp8_tflops(timer, dev, plan.bf16_matmul_n, plan.repeats)
            except (RuntimeError, TypeError) as e:
                notes.append(f"fp8 not measured: torch._scaled_mm failed ({str(e).splitlines()[0][:120]})")
        else:
            notes.append("fp8 not measured: needs compute capability >= 8.9 and torch._scaled_mm")
        tiny = torch.ones(1, device=dev)
        launch_us = timer(lambda: tiny.add_(1.0), plan.repeats, inner=100) * 1e6
    else:
        plan = CalibrationPlan.cpu(quick)
        bw, _ = _copy_bw(timer, dev, plan.copy_bytes, plan.repeats)
        peaks = {"fp32": _matmul_tflops(timer, dev, plan.matmul_n, torch.float32, plan.repeats),
                 "bf16": _matmul_tflops(timer, dev, plan.bf16_matmul_n, torch.bfloat16, plan.repeats)}
        notes.append("CPU: tf32/fp16/fp8 not measured (the roofline uses fp32/bf16 for them)")
        tiny = torch.ones(1)
        launch_us = timer(lambda: tiny.add_(1.0), plan.repeats, inner=100) * 1e6
    half_bw_us, sweep = _latency(timer, dev, bw, plan.sweep_max_bytes, plan.repeats)
    # No op is faster than the smallest one, so the threshold is at least its time.
    latency_us = max(half_bw_us, launch_us)
    notes.append(f"smallest op (1-element add_): {launch_us:.2f} us per call")
    notes.append("copy sweep (bytes, GB/s, us): " + ", ".join(f"{b}:{g}:{u}" for b, g, u in sweep))
    if quick:
        notes.append("quick calibration: small sizes and few repeats, less accurate")
    c = Ceilings(device=str(info.get("name") or dev), mem_bw_gbs=round(bw, 1),
                 peak_tflops={k: float(f"{v:.4g}") for k, v in peaks.items()}, latency_us=round(latency_us, 2),
                 source=f"measured by kprof calibrate on {_dt.date.today().isoformat()}"
                        + (" (quick)" if quick else ""), kind="measured", notes=notes)
    if save_cache:
        save(c, info)
    return c

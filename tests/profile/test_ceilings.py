"""kprof.analyze.ceilings: datasheet lookup, the cache, CPU calibration (quick), GPU calibration (marked)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kprof.analyze import ceilings
from kprof.analyze.ceilings import Ceilings
from kprof.errors import KprofError


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KPROF_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name,label,bw,bf16", [
    ("NVIDIA H200", "H200 SXM", 4800, 989.5),
    ("NVIDIA H200 NVL", "H200 NVL", 4800, 835.5),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3350, 989.5),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2000, 756),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 2039, 312),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1555, 312),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 1935, 312),
    ("NVIDIA L4", "L4", 300, 121),
    ("NVIDIA L40S", "L40S", 864, 362),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 1008, 165.2),
])
def test_datasheet_lookup(name, label, bw, bf16):
    c = ceilings.for_device({"type": "cuda", "name": name, "sm_count": 132})
    assert c.kind == "datasheet" and label in c.source and "datasheet" in c.source
    assert c.mem_bw_gbs == bw and c.peak("bf16") == bf16
    assert c.peak("tf32") >= c.peak("fp32") and c.latency_us == ceilings.DEFAULT_GPU_LATENCY_US


def test_peak_fallbacks():
    a100 = ceilings.datasheet_for("NVIDIA A100-SXM4-80GB")
    assert "fp8" not in a100.peak_tflops and a100.peak("fp8") == a100.peak("bf16")
    c = Ceilings("x", 100.0, {"fp32": 1.0}, 5.0, "test")
    assert c.peak("tf32") == 1.0 and c.peak("bf16") == 1.0
    assert c.ridge("fp32") == pytest.approx(1e12 / 100e9)


def test_unknown_gpu_and_uncalibrated_cpu():
    c = ceilings.for_device({"type": "cuda", "name": "Mystery GPU 9000", "sm_count": 10})
    assert c.kind == "unknown" and "kprof calibrate" in c.source and math.isnan(c.mem_bw_gbs)
    cpu = ceilings.for_device({"type": "cpu", "name": "Some CPU"})
    assert cpu.kind == "default" and "kprof calibrate" in cpu.source and cpu.mem_bw_gbs > 0


def test_cache_round_trip_and_corrupt_cache(cache_dir):
    dev = {"type": "cuda", "name": "NVIDIA H200", "sm_count": 132}
    measured = Ceilings("NVIDIA H200", 4300.0, {"fp32": 50.0, "bf16": 700.0}, 6.5, "measured by kprof calibrate",
                        kind="measured")
    path = ceilings.save(measured, dev)
    assert path.parent == cache_dir / "ceilings" and path.name == "cuda-nvidia-h200-sm132.json"
    assert ceilings.for_device(dev) == measured
    # a MIG slice (fewer SMs) does not share the calibration
    assert ceilings.for_device({**dev, "sm_count": 16}).kind == "datasheet"
    path.write_text("{not json")
    assert ceilings.for_device(dev).kind == "datasheet"


def test_calibrate_cpu_quick(cache_dir):
    dev = {"type": "cpu", "name": "test cpu"}
    c = ceilings.calibrate(dev, quick=True)
    assert c.kind == "measured" and "measured by kprof calibrate" in c.source
    assert c.mem_bw_gbs > 0 and c.peak_tflops["fp32"] > 0 and c.peak_tflops["bf16"] > 0
    assert c.latency_us > 0 and any("copy sweep" in n for n in c.notes)
    cached = json.loads(ceilings.cache_path(dev).read_text())
    assert cached["mem_bw_gbs"] == c.mem_bw_gbs
    assert ceilings.for_device(dev) == c


def test_calibrate_cuda_without_cuda_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(KprofError, match="CUDA"):
        ceilings.calibrate({"type": "cuda", "name": "x"}, quick=True)


@pytest.mark.gpu
def test_calibrate_gpu_quick(cache_dir):
    props = torch.cuda.get_device_properties(0)
    dev = {"type": "cuda", "name": props.name, "sm_count": props.multi_processor_count, "index": 0}
    c = ceilings.calibrate(dev, quick=True)
    assert c.kind == "measured" and set(c.peak_tflops) >= {"fp32", "tf32", "bf16", "fp16"}
    ds = ceilings.datasheet_for(props.name)
    if ds is not None:
        # Not a speed test: a measurement above the datasheet means a byte/FLOP counting bug.
        assert c.mem_bw_gbs <= 1.1 * ds.mem_bw_gbs
        for k in ("fp32", "tf32", "bf16", "fp16", "fp8"):
            if k in c.peak_tflops and k in ds.peak_tflops:
                assert c.peak_tflops[k] <= 1.1 * ds.peak_tflops[k], k
    assert ceilings.for_device(dev) == c

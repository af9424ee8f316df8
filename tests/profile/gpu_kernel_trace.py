"""A GPU trace with Kineto's kernel launch arguments, hand-written in Kineto's Chrome-trace format
(no GPU trace can be recorded on a CPU machine; the argument names are libkineto's
ChromeTraceLogger's: "grid", "block", "registers per thread", "shared memory", "blocks per SM",
"warps per SM", "est. achieved occupancy %"). Used by test_kernels.py and tests/cli.

One recorded step (host 0-1000 us), one H200 (132 SMs):
- proj (Linear): aten::mm 4096x4096 @ 4096x4096 bf16, two kernels: the GEMM (200 us) and a
  split-K reduce (20 us);
- rope (Rotary): aten::add of two bf16 [8, 2048, 32, 64] views with a row stride of 128
  (non-contiguous: a half of a [.., 128] tensor), 150 us, a big grid;
- head (Linear): aten::mul of two fp32 [64, 1001] tensors (innermost 4004 B, not a multiple of
  16), 8 us, 64 blocks on 132 SMs;
- act (GELU): a Triton kernel launched outside any op (cuLaunchKernel), 30 us;
- a host-to-device memcpy (no launch arguments).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

T0 = 5_000_000.0
SMS = 132


def _x(name, cat, ts, dur, tid=1, pid=100, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + ts, "dur": dur, "args": args}


def _op(name, ts, dur, dims, types, strides=None):
    return _x(name, "cpu_op", ts, dur, **{"External id": 0, "Input Dims": dims, "Input type": types,
                                          "Input Strides": strides or [[] for _ in dims],
                                          "Concrete Inputs": ["" for _ in dims]})


def _launch(ts, corr, name="cudaLaunchKernel", cat="cuda_runtime"):
    return _x(name, cat, ts, 2.0, correlation=corr)


def _kernel(name, ts, dur, corr, grid, block, occ, regs=32, smem=0):
    blocks = grid[0] * grid[1] * grid[2]
    threads = block[0] * block[1] * block[2]
    return _x(name, "kernel", ts, dur, tid=7, pid=0, queued=0, device=0, context=1, stream=7, correlation=corr,
              **{"registers per thread": regs, "shared memory": smem, "blocks per SM": blocks / SMS,
                 "warps per SM": blocks / SMS * threads / 32, "grid": list(grid), "block": list(block),
                 "est. achieved occupancy %": occ})


BF16, FP32 = "c10::BFloat16", "float"


def trace() -> dict:
    ev = [
        _x("kprof.step#0", "user_annotation", 0, 1000),
        _x("kprof.module::Net", "user_annotation", 1, 900),
        _x("kprof.module:proj:Linear", "user_annotation", 2, 100),
        _op("aten::mm", 3, 50, [[4096, 4096], [4096, 4096]], [BF16, BF16], [[4096, 1], [4096, 1]]),
        _launch(5, 1), _launch(10, 2),
        _x("kprof.module:rope:Rotary", "user_annotation", 110, 100),
        _op("aten::add", 111, 50, [[8, 2048, 32, 64], [8, 2048, 32, 64], []], [BF16, BF16, "Scalar"],
            [[8388608, 4096, 128, 1], [8388608, 4096, 128, 1], []]),
        _launch(112, 3),
        _x("kprof.module:head:Linear", "user_annotation", 220, 100),
        _op("aten::mul", 221, 50, [[64, 1001], [64, 1001]], [FP32, FP32], [[1001, 1], [1001, 1]]),
        _launch(222, 4),
        _x("kprof.module:act:GELU", "user_annotation", 330, 50),
        _launch(331, 5, name="cuLaunchKernel", cat="cuda_driver"),
        _launch(400, 6, name="cudaMemcpyAsync"),
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 20, 200, 1, (132, 1, 1), (384, 1, 1), 19, regs=168, smem=200_000),
        _kernel("splitKreduce_kernel", 220, 20, 2, (256, 1, 1), (128, 1, 1), 50),
        _kernel("elementwise_kernel_add", 240, 150, 3, (65536, 1, 1), (128, 1, 1), 100),
        _kernel("vectorized_elementwise_kernel_mul", 390, 8, 4, (64, 1, 1), (128, 1, 1), 3),
        _kernel("triton_poi_fused_gelu_0", 400, 30, 5, (1000, 1, 1), (256, 1, 1), 75),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 430, 10, tid=7, pid=0, device=0, stream=7,
           correlation=6, bytes=1 << 20),
    ]
    return {"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "numSms": SMS}]}


def write(path: Path) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump(trace(), f)
    return path

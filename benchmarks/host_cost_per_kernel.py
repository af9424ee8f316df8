"""Host (CPU) time per fwd+bwd call of every kprof kernel, beside Liger Kernel and the aten ops it
replaces: the table of issue 19 ("a lean path for every patched call").

    python benchmarks/host_cost_per_kernel.py [--csv FILE] [--chain 64]

Reproduces benchmarks/results/host-cost-per-kernel-h200-*.csv (see docs/results.md).

Method. Tiny tensors (8 rows of 256), so every kernel's GPU time (a few us) is under its launch
cost and the wall time of a chain is the host's. One measurement is a chain of `--chain` calls
whose outputs are summed into one loss, then one `backward()`: the autograd engine's start is paid
once per chain, as in a training step, not once per call. Host us per call =
(median wall time of the chain - median wall time of the same chain with the calls replaced by
identity) / chain length, over 30 repeats after 5 warm-ups, with the GPU synchronized before and
after each chain. Launch counts per direction come from torch.profiler over one call.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

ROWS, COLS = 8, 256


def _cases(dev: torch.device) -> dict[str, dict[str, Callable]]:
    """name -> {impl: make() -> (inputs requiring grad, call(inputs) -> tensor)}."""
    from kprof.kernels import bias_gelu, cross_entropy, fused_linear_cross_entropy, glu, layer_norm, rms_norm, rope
    from kprof.kernels import softmax as ksoftmax

    bf = torch.bfloat16

    def x(*shape, dtype=bf):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    try:
        from liger_kernel.transformers import functional as lf
    except ImportError:
        lf = None

    def rope_inputs():
        q, k = x(1, 2, ROWS, 64), x(1, 2, ROWS, 64)
        ang = torch.randn(1, ROWS, 64, device=dev, dtype=bf)
        return (q, k, ang.cos(), ang.sin())

    def add_pair(ys):  # both outputs into the loss, one add for every impl
        return ys[0] + ys[1]

    def aten_rms_norm(h, w):
        return (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf) * w

    def aten_rms_norm_add(x, r, w):
        s = x + r
        return aten_rms_norm(s, w), s

    def rotate(t):
        a, b = t.chunk(2, -1)
        return torch.cat((-b, a), -1)

    cases = {
        "rms_norm": {
            "inputs": lambda: (x(ROWS, COLS), x(COLS)),
            "kprof": lambda i: rms_norm.rms_norm(i[0], i[1], 1e-6),
            "liger": lf and (lambda i: lf.liger_rms_norm(i[0], i[1], 1e-6, in_place=False)),
            "aten": lambda i: aten_rms_norm(i[0], i[1]),
        },
        "rms_norm_add": {
            "inputs": lambda: (x(ROWS, COLS), x(ROWS, COLS), x(COLS)),
            "kprof": lambda i: add_pair(rms_norm.rms_norm_add(i[0], i[1], i[2], 1e-6)),
            "liger": None,
            "aten": lambda i: add_pair(aten_rms_norm_add(*i)),
        },
        "layer_norm": {
            "inputs": lambda: (x(ROWS, COLS), x(COLS), x(COLS)),
            "kprof": lambda i: layer_norm.layer_norm(i[0], i[1], i[2], 1e-5),
            "liger": lf and (lambda i: lf.liger_layer_norm(i[0], i[1], i[2], 1e-5)),
            "aten": lambda i: F.layer_norm(i[0], (COLS,), i[1], i[2], 1e-5),
        },
        "swiglu": {
            "inputs": lambda: (x(ROWS, COLS), x(ROWS, COLS)),
            "kprof": lambda i: glu.swiglu(i[0], i[1]),
            "liger": lf and (lambda i: lf.liger_swiglu(i[0], i[1])),
            "aten": lambda i: F.silu(i[0]) * i[1],
        },
        "geglu": {
            "inputs": lambda: (x(ROWS, COLS), x(ROWS, COLS)),
            "kprof": lambda i: glu.geglu(i[0], i[1], "tanh"),
            "liger": lf and (lambda i: lf.liger_geglu(i[0], i[1])),
            "aten": lambda i: F.gelu(i[0], approximate="tanh") * i[1],
        },
        "bias_gelu": {
            "inputs": lambda: (x(ROWS, COLS), x(COLS)),
            "kprof": lambda i: bias_gelu.bias_gelu(i[0], i[1], "tanh"),
            "liger": None,
            "aten": lambda i: F.gelu(i[0] + i[1], approximate="tanh"),
        },
        "softmax": {
            "inputs": lambda: (x(ROWS, COLS),),
            "kprof": lambda i: ksoftmax.softmax(i[0], scale=0.125),
            "liger": lf and (lambda i: lf.liger_softmax(i[0] * 0.125)),
            "aten": lambda i: torch.softmax(i[0] * 0.125, -1),
        },
        "rope": {
            "inputs": rope_inputs,
            "kprof": lambda i: sum(rope.apply_rope(i[0], i[1], i[2], i[3])),
            "liger": lf and (lambda i: sum(lf.liger_rope(i[0], i[1], i[2], i[3]))),
            "aten": lambda i: (i[0] * i[2].unsqueeze(1) + rotate(i[0]) * i[3].unsqueeze(1))
            + (i[1] * i[2].unsqueeze(1) + rotate(i[1]) * i[3].unsqueeze(1)),
        },
        "cross_entropy": {
            "inputs": lambda: (x(ROWS, 1024), torch.randint(0, 1024, (ROWS,), device=dev)),
            "kprof": lambda i: cross_entropy.cross_entropy(i[0], i[1]),
            "liger": lf and (lambda i: lf.liger_cross_entropy(i[0], i[1])),
            "aten": lambda i: F.cross_entropy(i[0].float(), i[1]),
        },
        "linear_cross_entropy": {
            "inputs": lambda: (x(ROWS, COLS), x(1024, COLS), torch.randint(0, 1024, (ROWS,), device=dev)),
            "kprof": lambda i: fused_linear_cross_entropy.linear_cross_entropy(i[0], i[1], i[2]),
            "liger": lf and (lambda i: lf.liger_fused_linear_cross_entropy(i[0], i[1], i[2])),
            "aten": lambda i: F.cross_entropy((i[0] @ i[1].t()).float(), i[2]),
        },
    }
    return cases


def _chain_s(make_inputs, call, chain: int, repeats: int, sync) -> float:
    inputs = [make_inputs() for _ in range(chain)]

    def once():
        sync()
        t = time.perf_counter()
        loss = sum(call(i).float().sum() for i in inputs)
        loss.backward()
        sync()
        return time.perf_counter() - t

    for _ in range(5):
        once()
    return statistics.median(once() for _ in range(repeats))


def _launches(make_inputs, call) -> tuple[int, int]:
    """(kernels in the forward, kernels in the backward) of one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    i = make_inputs()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        y = call(i).float().sum()
        torch.cuda.synchronize()
    fwd = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        y.backward()
        torch.cuda.synchronize()
    bwd = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return fwd, bwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", help="append the rows to this CSV")
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--only", help="comma-separated kernel names")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost_per_kernel: needs a CUDA GPU (host cost of GPU launches)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    rows = []
    for name, c in _cases(dev).items():
        if a.only and name not in a.only.split(","):
            continue
        base = _chain_s(c["inputs"], lambda i: i[0], a.chain, a.repeats, sync)
        for impl in ("kprof", "liger", "aten"):
            call = c[impl]
            if call is None:
                continue
            try:
                t = _chain_s(c["inputs"], call, a.chain, a.repeats, sync)
                fwd, bwd = _launches(c["inputs"], call)
            except Exception as e:  # a Liger version without this op: say so, keep going
                print(f"{name:22s} {impl:6s} failed: {type(e).__name__}: {e}", flush=True)
                continue
            us = (t - base) / a.chain * 1e6
            rows.append({"kernel": name, "impl": impl, "host_us_per_fwd_bwd": round(us, 1),
                         "launches_fwd": fwd, "launches_bwd": bwd, "chain": a.chain})
            print(f"{name:22s} {impl:6s} {us:7.1f} us/call fwd+bwd  launches {fwd}+{bwd}", flush=True)
    if a.csv and rows:
        import datetime as dt

        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        gpu = torch.cuda.get_device_name()
        new = not __import__("os").path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            w = csv.DictWriter(f, ["date", "gpu", "torch", *rows[0]])
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({"date": stamp, "gpu": gpu, "torch": torch.__version__, **r})
    return 0


if __name__ == "__main__":
    sys.exit(main())

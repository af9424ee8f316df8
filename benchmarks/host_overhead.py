"""Host (Python) cost per call of each layer a kprof kernel call goes through.

    python benchmarks/host_overhead.py

Tiny tensors so GPU time is negligible; perf_counter over many calls after warm-up.
Measured to decide how the eager path should reach the Triton launcher (see kernels/common.py,
`via_custom_op`).

Reproduces: benchmarks/results/host-overhead-h200-20261129.txt, the top README's "a custom-op call
costs 30 us against 24 us for a bare Triton launch" and the ~12 us per aten op that
bench_kernels.py, kprof's launch-bound diagnosis and `suggest` quote (H200 machine, 2026-11-29).
"""

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _copy(x, y, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)


def launch(x):
    y = torch.empty_like(x)
    _copy[(1,)](x, y, x.numel(), B=1024)
    return y


@torch.library.custom_op("kprof_bench::copy", mutates_args=())
def copy_op(x: torch.Tensor) -> torch.Tensor:
    return launch(x)


@copy_op.register_fake
def _(x):
    return torch.empty_like(x)


lib = torch.library.Library("kprof_bench2", "DEF")
lib.define("copy(Tensor x) -> Tensor")
lib.impl("copy", launch, "CUDA")


class Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return launch(x)

    @staticmethod
    def backward(ctx, g):
        return launch(g)


class FnOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return copy_op(x)

    @staticmethod
    def backward(ctx, g):
        return copy_op(g)


def bench(name, f, n=2000):
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    print(f"{name:45s} {(time.perf_counter() - t) / n * 1e6:7.1f} us/call", flush=True)


x = torch.randn(1000, device="cuda")
xg = x.clone().requires_grad_()
g = torch.randn_like(x)
bench("torch.empty_like", lambda: torch.empty_like(x))
bench("x + 1 (one aten kernel)", lambda: x + 1)
bench("triton launch (direct)", lambda: launch(x))
bench("torch.library.custom_op", lambda: copy_op(x))
bench("torch.ops via Library.define/impl", lambda: torch.ops.kprof_bench2.copy(x))
bench("autograd.Function -> launch, fwd only", lambda: Fn.apply(x))
bench("autograd.Function -> launch, fwd+bwd", lambda: Fn.apply(xg).backward(g))
bench("autograd.Function -> custom_op, fwd+bwd", lambda: FnOp.apply(xg).backward(g))
with torch.profiler.record_function("x"):
    pass
bench("record_function (no profiler)", lambda: torch.profiler.record_function("kprof::x").__enter__().__exit__(None, None, None))

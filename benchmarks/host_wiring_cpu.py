"""Host time of kprof's wiring layer per fwd+bwd call, on a CPU, with every Triton launch stubbed.

    TRITON_INTERPRET=1 python benchmarks/host_wiring_cpu.py [--chain 64] [--repeats 30]

What it measures: the Python and aten work kprof does around its launches (checks, launch
plans, output allocations, the autograd.Function, strides), not the launches themselves, which
need a GPU. Each kernel module's Triton kernels are replaced by a stub whose `[grid](...)` does
nothing, so the autograd graph, the allocations and every per-call decision still run. As in
benchmarks/host_cost_per_kernel.py, one measurement is a chain of `--chain` calls summed into one
loss and one `backward()`, and host us per call = (median chain time - median time of the same
chain with identity calls) / chain length. CPU figures: they rank changes to the wiring; they are
not the H200 host's figures (docs/results.md has those).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path (the stubs)

import torch  # noqa: E402

ROWS, COLS = 8, 256


class _Stub:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` does nothing."""

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        return None


def _stub_kernels() -> None:
    from kprof.kernels import bias_gelu, glu, layer_norm, rms_norm, rope, softmax

    for mod in (bias_gelu, glu, layer_norm, rms_norm, rope, softmax):
        for name in list(vars(mod)):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, _Stub())


def _cases():
    from kprof.kernels import bias_gelu, glu, layer_norm, rms_norm, rope, softmax

    bf = torch.bfloat16

    def x(*shape):
        return torch.randn(*shape, dtype=bf, requires_grad=True)

    def rope_inputs():
        ang = torch.randn(1, ROWS, 64)
        return (x(1, 2, ROWS, 64), x(1, 2, ROWS, 64), ang.cos().to(bf), ang.sin().to(bf))

    return {
        "rms_norm": (lambda: (x(ROWS, COLS), x(COLS)), lambda i: rms_norm.rms_norm(i[0], i[1], 1e-6)),
        "layer_norm": (lambda: (x(ROWS, COLS), x(COLS), x(COLS)), lambda i: layer_norm.layer_norm(i[0], i[1], i[2])),
        "swiglu": (lambda: (x(ROWS, COLS), x(ROWS, COLS)), lambda i: glu.swiglu(i[0], i[1])),
        "geglu": (lambda: (x(ROWS, COLS), x(ROWS, COLS)), lambda i: glu.geglu(i[0], i[1], "tanh")),
        "bias_gelu": (lambda: (x(ROWS, COLS), x(COLS)), lambda i: bias_gelu.bias_gelu(i[0], i[1], "tanh")),
        "softmax": (lambda: (x(ROWS, COLS),), lambda i: softmax.softmax(i[0], scale=0.5)),
        "rope": (rope_inputs, lambda i: rope.apply_rope(*i)[0]),
    }


def _chain_s(call, inputs, chain: int) -> float:
    t0 = time.perf_counter()
    loss = None
    for _ in range(chain):
        out = call(inputs)
        loss = out.sum() if loss is None else loss + out.sum()
    loss.backward()
    return time.perf_counter() - t0


def measure(chain: int, repeats: int) -> dict[str, float]:
    _stub_kernels()
    torch.set_num_threads(1)
    results = {}
    for name, (make, call) in _cases().items():
        inputs = make()
        identity = lambda i: i[0] * 1.0  # noqa: E731  (one aten op, so the chain still builds a graph)
        times = {}
        for label, fn in (("kprof", call), ("identity", identity)):
            for _ in range(5):
                _chain_s(fn, inputs, chain)
            times[label] = statistics.median(_chain_s(fn, inputs, chain) for _ in range(repeats))
        results[name] = (times["kprof"] - times["identity"]) / chain * 1e6
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    for name, us in measure(args.chain, args.repeats).items():
        print(f"{name:12s} {us:8.1f} us per fwd+bwd call (wiring only, launches stubbed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

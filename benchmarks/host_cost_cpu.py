"""Host time of kprof's own Python per fwd+bwd call, on a CPU, with every Triton launch stubbed,
beside the aten code each kernel replaces.

    python benchmarks/host_cost_cpu.py [--csv benchmarks/results/host-cost-cpu-stubbed.csv]
                                       [--chain 64] [--repeats 60] [--only rms_norm,softmax] [--label X]

Reproduces benchmarks/results/host-cost-cpu-stubbed.csv, the CPU proxy of issue 19's table
(benchmarks/host_cost_per_kernel.py, H200 host; same cases, same chain): the part of each
call kprof controls, its Python wrapper (checks, launch plans, output allocations, views, the
dispatch decision) with the autograd.Function and engine work it goes through, not the
launches, which need a GPU. It is not the GPU host's figure: a real launch adds ~24 us per
kernel on the H200 host (benchmarks/results/host-overhead-h200-20261129.txt), that host's CPU
is not this one, and here (CPU tensors) `use_triton` reads TRITON_INTERPRET once per call,
which a CUDA tensor skips; the stub's own call (~2-4 us a launch) stays in.

Method. TRITON_INTERPRET=1 so CPU tensors take the Triton path; each kernel module's Triton
kernels are replaced by a stub whose `[grid](...)` does nothing, so everything around the launch
still runs. The aten rows run aten's real CPU compute on the tiny tensors (8 rows of 256,
bf16), so they include a little arithmetic kprof's stubbed rows do not. One measurement is a
chain of `--chain` calls summed into one loss and one `backward()`; every kernel's impls and
an identity chain are timed in turn within each repeat (interleaved, as other processes share
the cores; and timed in process CPU time, which time spent descheduled does not inflate), and
host us per call = (median chain time - median identity chain time) / chain.
To compare two trees, run this script from each in turn, several rounds (`--label` names the
tree in the CSV).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors take the Triton path (the stubs)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.host_cost_per_kernel import _cases  # noqa: E402

# Every kprof kernel with a Triton eager path whose launches are one per direction (plus the
# norms' small weight-grad reduction).
KERNELS = ("rms_norm", "rms_norm_add", "layer_norm", "swiglu", "geglu", "bias_gelu", "softmax", "rope")


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


def _chain_once(call, inputs) -> float:
    # Process CPU time, not wall time: other processes share these cores, and time spent
    # descheduled is not the wrapper's (one thread: torch.set_num_threads(1), CPU autograd runs
    # on the calling thread).
    t0 = time.process_time()
    loss = sum(call(i).float().sum() for i in inputs)
    loss.backward()
    return time.process_time() - t0


def measure(names, chain: int, repeats: int) -> list[dict]:
    _stub_kernels()
    torch.set_num_threads(1)
    calls = {}  # (kernel, impl) -> (call, its chain of inputs)
    for name, case in _cases(torch.device("cpu")).items():
        if name in names:
            for impl, call in (("kprof", case["kprof"]), ("aten", case["aten"]), ("identity", lambda i: i[0])):
                calls[name, impl] = call, [case["inputs"]() for _ in range(chain)]
    # Repeats outermost: a burst of load from other processes then lands on every kernel and
    # impl alike instead of on the one being measured.
    times = {key: [] for key in calls}
    for r in range(5 + repeats):
        for key, (call, inputs) in calls.items():
            t = _chain_once(call, inputs)
            if r >= 5:  # the first 5: warm-up
                times[key].append(t)
    rows = []
    for name in dict.fromkeys(k for k, _ in calls):
        base = statistics.median(times[name, "identity"])
        for impl in ("kprof", "aten"):
            us = (statistics.median(times[name, impl]) - base) / chain * 1e6
            rows.append({"kernel": name, "impl": impl, "us": round(us, 1)})
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _tree_label() -> str:
    import kprof.kernels

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(kprof.kernels.__file__).parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", help="append the rows to this CSV")
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--only", help="comma-separated kernel names (default: all of KERNELS)")
    ap.add_argument("--label", help="the tree measured, for the CSV (default: git HEAD of kprof.kernels)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else KERNELS
    rows = measure(names, args.chain, args.repeats)
    for r in rows:
        print(f"{r['kernel']:13s} {r['impl']:6s} {r['us']:7.1f} us per fwd+bwd call (launches stubbed)", flush=True)
    if args.csv:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
        common = {"date": stamp, "cpu": _cpu_model(), "torch": torch.__version__, "tree": args.label or _tree_label()}
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, [*common, "kernel", "impl", "us", "repeats", "chain"])
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({**common, **r, "repeats": args.repeats, "chain": args.chain})
    return 0


if __name__ == "__main__":
    sys.exit(main())

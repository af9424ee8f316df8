"""Where does a kernel's fwd+bwd time go? GPU kernel time (torch.profiler) vs wall time (do_bench).

    python benchmarks/diagnose.py [--only rms_norm,softmax]

For each benchmark case and implementation: do_bench median of fwd+bwd, the summed GPU kernel
time per iteration from torch.profiler (each kernel by name), and the host time per iteration.
If do_bench >> kernel time, the gap is host overhead or a sync, not the kernels.

Reproduces: benchmarks/results/diagnose-h200-20261129T1941.txt, the top README's "Host-bound wall
times" (a Triton launch through JITFunction.run costs 50-100 us of host time on the H200 machine,
autograd's run_backward 60-180 us; do_bench fwd+bwd of the norms and RoPE is 2-4x their GPU time):
    python benchmarks/diagnose.py --cprofile                (H200; `bash benchmarks/gpu_run.sh diagnose`)
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_kernels import _grad_leaves, _outputs, _run_fwd_bwd, load_cases  # noqa: E402


def _host_profile(step, leaves, iters: int = 200) -> None:
    """Where the host time of one call goes, Python function by function (cProfile, tottime per
    call). The GPU runs asynchronously; a cudaMalloc, a sync or a slow launch path shows up here."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(iters):
        for x in leaves:
            x.grad = None
        step()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    total = st.total_tt / iters * 1e6
    print(f"      host per call (cProfile, {iters} calls): {total:.1f} us; top functions by own time per call:")
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]
    for (file, line, fn), (cc, nc, tt, ct, _) in rows:
        print(f"      {tt / iters * 1e6:8.1f} us own {ct / iters * 1e6:8.1f} us cum  {nc / iters:5.1f}x  {Path(file).name}:{line}({fn})")


def resource_report() -> None:
    """Registers, spills and warps of every kprof Triton kernel compiled in this process (the
    compiler's resource report; a spill or a register count that halves occupancy explains a
    bandwidth shortfall better than a guess)."""
    import importlib
    import pkgutil

    import triton

    import kprof.kernels as kpkg

    print("## compiled kprof Triton kernels: name, n_regs, n_spills, num_warps, shared bytes")
    for info in pkgutil.iter_modules(kpkg.__path__):
        mod = importlib.import_module(f"kprof.kernels.{info.name}")
        for name, obj in vars(mod).items():
            # An autotuned kernel wraps its JITFunction in .fn; a JITFunction's own .fn is the Python function.
            fn = obj if isinstance(obj, triton.runtime.jit.JITFunction) else getattr(obj, "fn", None)
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                continue
            caches = getattr(fn, "device_caches", None) or {}
            for dev_cache in caches.values():
                kernels = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
                for key, k in list(kernels.items()):
                    meta = getattr(k, "metadata", None)
                    print(f"{info.name}.{name}: regs {getattr(k, 'n_regs', '?')} spills {getattr(k, 'n_spills', '?')} "
                          f"warps {getattr(meta, 'num_warps', '?')} shared {getattr(meta, 'shared', '?')} "
                          f"key {str(key)[:160]}")


def main() -> None:
    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--cprofile", action="store_true", help="also print the host's Python-level cost per call (cProfile)")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    for case in load_cases(only):
        inputs = case.make_inputs("cuda", torch.bfloat16)
        leaves = _grad_leaves(inputs)
        fns = {"kprof": case.kprof, "eager": case.eager}
        if case.liger is not None:
            try:
                fns["liger"] = case.liger()
            except Exception:  # noqa: BLE001
                pass
        for name, fn in fns.items():
            outs = [o for o in _outputs(fn(**inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]
            del outs
            step = (lambda: _run_fwd_bwd(fn, inputs, grads)) if case.backward else (lambda: fn(**inputs))
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            m0 = torch.cuda.memory_stats()
            t = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=leaves, return_mode="median") * 1e3
            m1 = torch.cuda.memory_stats()
            # cudaMalloc/cudaFree inside the timing loop are host time (and implicit syncs) that a
            # warm training loop would not pay; count them to tell allocator churn from launch cost.
            mallocs = m1.get("num_device_alloc", 0) - m0.get("num_device_alloc", 0)
            frees = m1.get("num_device_free", 0) - m0.get("num_device_free", 0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    for x in leaves:
                        x.grad = None
                    step()
                torch.cuda.synchronize()
            per_kernel = defaultdict(float)
            host = 0.0
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[e.name[:70]] += e.device_time / args.iters
            syncs = sum(1 for e in prof.events() if "Synchronize" in e.name) / args.iters
            host = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU) / args.iters
            gpu = sum(per_kernel.values())
            print(f"{case.label:55s} {name:6s} do_bench {t:8.1f} us | kernels {gpu:8.1f} us | host {host:8.1f} us | syncs/iter {syncs:.1f} | cudaMalloc {mallocs} cudaFree {frees} in do_bench")
            for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:4]:
                print(f"      {v:8.1f} us  {k}")
            if args.cprofile:
                # Host time by op across threads (the backward runs on autograd's device thread,
                # which cProfile below does not see).
                avg = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
                print("      host self time by op per call (torch.profiler, all threads):")
                for a in avg:
                    print(f"      {a.self_cpu_time_total / args.iters:8.1f} us  {a.count / args.iters:5.1f}x  {a.key[:70]}")
            for x in leaves:
                x.grad = None
            if args.cprofile:
                _host_profile(step, leaves)
        inputs = leaves = None  # free before the next case's inputs
        torch.cuda.empty_cache()
    resource_report()


if __name__ == "__main__":
    main()

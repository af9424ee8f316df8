"""MoE router benchmark: fwd+bwd wall time of kprof's router (CUDA kernel, Triton kernel) against
the eager reference and torch.compile of the reference, and the CUDA extension's first-load
(compile) and cached-load times.

NOT YET RUN: written without GPU time (2026-12-02); no figure from it is recorded anywhere yet.

    python benchmarks/bench_moe_kernels.py [--tokens 16384,131072] [--experts 8,64,256] [--csv FILE]

Method: each time is the median of `triton.testing.do_bench(fn, return_mode="median")` over a
Python call of forward + backward (wall time, no CUDA graphs: host time is part of what the
router saves). k = 2 for 8 experts (Mixtral), 8 for 64 and 256 (OLMoE, DeepSeek); bf16 logits,
softmax with renormalisation. Correctness (indices, counts, offsets exactly; weights) is checked
before anything is timed. The load times run in fresh processes with an empty $KPROF_CACHE_DIR:
the first builds the extension (nvcc), the second imports it from the cache.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K_FOR = {8: 2, 64: 8, 256: 8}

_LOAD = ("import time, torch; from kprof.kernels import cuda_jit, moe_router as R; torch.cuda.init(); "
         "t = time.perf_counter(); _, how = cuda_jit.load(R.extension_source(), cuda_jit.arch_of(torch.device('cuda'))); "
         "torch.cuda.synchronize(); print(how, time.perf_counter() - t)")


def load_times() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "KPROF_CACHE_DIR": d}
        out = {}
        for label in ("first_load_s", "cached_load_s"):
            p = subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, env=env, check=True)
            how, secs = p.stdout.split()
            out[label] = float(secs)
            out[label.replace("_s", "_how")] = how
        return out


def fwd_bwd(route, logits, k):
    def step():
        x = logits.detach().requires_grad_()
        out = route(x, k)
        out.weights.backward(torch.ones_like(out.weights))
    return step


def main() -> None:
    import triton.testing

    from kprof.kernels import moe_router as R

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,131072")
    ap.add_argument("--experts", default="8,64,256")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "moe_router.csv"))
    args = ap.parse_args()

    loads = load_times()
    print(f"router extension: first load {loads['first_load_s']:.2f} s ({loads['first_load_how']}), "
          f"cached load {loads['cached_load_s']:.3f} s ({loads['cached_load_how']})")
    compiled = torch.compile(R.moe_router_reference)
    impls = {
        "kprof_cuda": ("cuda", R.moe_router),
        "kprof_triton": ("triton", R.moe_router),
        "eager": ("reference", R.moe_router_reference),
        "torch_compile": ("reference", compiled),
    }
    rows = []
    for t in map(int, args.tokens.split(",")):
        for e in map(int, args.experts.split(",")):
            k = K_FOR.get(e, 8)
            logits = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
            ref = R.moe_router_reference(logits, k)
            for name, (backend, fn) in impls.items():
                os.environ["KPROF_MOE_ROUTER_BACKEND"] = backend
                out = fn(logits, k)
                # Exact selection is only required where scores differ (bf16 logits tie often);
                # counts must sum to t * k regardless.
                assert int(out.counts.sum()) == t * k and torch.equal(out.offsets[-1:], ref.offsets[-1:]), name
                ms = triton.testing.do_bench(fwd_bwd(fn, logits, k), return_mode="median")
                rows.append({"tokens": t, "experts": e, "k": k, "impl": name, "fwd_bwd_us": round(ms * 1e3, 1)})
                print(f"T={t:>6} E={e:>3} k={k}  {name:<14} {ms * 1e3:9.1f} us")
    os.environ.pop("KPROF_MOE_ROUTER_BACKEND", None)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, **{k: loads[k] for k in ("first_load_s", "cached_load_s")}}
    path = Path(args.csv)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*meta, *rows[0]])
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**meta, **r})


if __name__ == "__main__":
    main()

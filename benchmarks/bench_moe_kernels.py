"""MoE kernels benchmark.

Router (`--what router`): fwd+bwd wall time of kprof's router (CUDA kernel, Triton kernel)
against the eager reference and torch.compile of the reference, and the CUDA extension's
first-load (compile) and cached-load times.

Experts (`--what experts`): fwd+bwd wall time of the experts' two GEMMs and SwiGLU at one layer
shape (default the issue's Mixtral layer: 8 experts x 512 rows, H 1024, I 2816, bf16):
`torch._grouped_mm` + packed SwiGLU (`moe_experts`' first choice), the Triton grouped GEMM with
the fused SwiGLU (`moe_grouped_gemm`), the per-expert loop (`moe_experts_reference`) and
torch.compile of that loop.

NOT YET RUN: written without GPU time (2026-12-02); no figure from it is recorded anywhere yet.

    python benchmarks/bench_moe_kernels.py [--what all|router|experts] [--tokens 16384,131072]
        [--experts 8,64,256] [--layer 8,512,1024,2816] [--csv FILE] [--experts-csv FILE]

Method: each time is the median of `triton.testing.do_bench(fn, return_mode="median")` over a
Python call of forward + backward (wall time, no CUDA graphs: host time is part of what the
router saves, and the loop's host syncs are what the grouped GEMMs remove). Router: k = 2 for 8
experts (Mixtral), 8 for 64 and 256 (OLMoE, DeepSeek); bf16 logits, softmax with
renormalisation. Correctness (indices, counts, offsets exactly; weights) is checked before
anything is timed. The load times run in fresh processes with an empty $KPROF_CACHE_DIR: the
first builds the extension (nvcc), the second imports it from the cache. Experts: each
implementation's output and grads are checked against the loop's first (relative Frobenius
error within the bf16 tolerance's rtol) before it is timed.
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


def experts_fwd_bwd(fn, x, offs, wgu, wd, dy):
    leaves = [t.detach().requires_grad_() for t in (x, wgu, wd)]

    def step():
        for t in leaves:
            t.grad = None
        y = fn(leaves[0], offs, leaves[1], leaves[2])
        y.backward(dy)
        return [y, leaves[0].grad, leaves[1].grad, leaves[2].grad]
    return step


def bench_experts(layer: str, csv_path: str) -> None:
    import triton.testing

    from kprof.kernels import moe_experts as X
    from kprof.kernels import moe_grouped_gemm as G
    from kprof.kernels.common import tol

    n_experts, rows, hidden, inter = map(int, layer.split(","))
    dtype, dev = torch.bfloat16, "cuda"
    x = torch.randn(n_experts * rows, hidden, device=dev, dtype=dtype)
    wgu = (torch.randn(n_experts, hidden, 2 * inter, device=dev) / hidden**0.5).to(dtype)
    wd = (torch.randn(n_experts, inter, hidden, device=dev) / inter**0.5).to(dtype)
    offs = torch.arange(1, n_experts + 1, device=dev, dtype=torch.int32) * rows
    dy = torch.randn_like(x)
    impls = {
        "grouped_mm": X.moe_experts,
        "triton": G.moe_grouped_gemm,
        "loop": X.moe_experts_reference,
        "loop_compiled": torch.compile(X.moe_experts_reference),
    }
    backend = X.grouped_mm_backend(x, wgu, wd)
    if backend != "grouped_mm":
        print(f"experts: torch._grouped_mm does not run here (moe_experts would use {backend}); skipping it")
        del impls["grouped_mm"]
    ref = experts_fwd_bwd(X.moe_experts_reference, x, offs, wgu, wd, dy)()
    rows_out = []
    for name, fn in impls.items():
        got = experts_fwd_bwd(fn, x, offs, wgu, wd, dy)()
        for what, a, b in zip(("y", "dx", "dw_gate_up", "dw_down"), got, ref):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            assert err <= tol(dtype).rtol, f"{name} {what}: relative Frobenius error {err:.3g}"
        ms = triton.testing.do_bench(experts_fwd_bwd(fn, x, offs, wgu, wd, dy), return_mode="median")
        rows_out.append({"experts": n_experts, "rows_per_expert": rows, "hidden": hidden, "inter": inter,
                         "impl": name, "fwd_bwd_us": round(ms * 1e3, 1)})
        print(f"experts E={n_experts} rows={rows} H={hidden} I={inter}  {name:<14} {ms * 1e3:9.1f} us")
    write_csv(csv_path, {}, rows_out)


def write_csv(csv_path: str, meta: dict, rows: list[dict]) -> None:
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **meta}
    path = Path(csv_path)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*meta, *rows[0]])
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**meta, **r})


def bench_router(tokens: str, experts: str, csv_path: str) -> None:
    import triton.testing

    from kprof.kernels import moe_router as R

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
    for t in map(int, tokens.split(",")):
        for e in map(int, experts.split(",")):
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
    write_csv(csv_path, {k: loads[k] for k in ("first_load_s", "cached_load_s")}, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("all", "router", "experts"), default="all")
    ap.add_argument("--tokens", default="16384,131072", help="router: token counts")
    ap.add_argument("--experts", default="8,64,256", help="router: expert counts")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "moe_router.csv"))
    ap.add_argument("--layer", default="8,512,1024,2816",
                    help="experts: n_experts,rows_per_expert,hidden,intermediate (default: the issue's Mixtral layer)")
    ap.add_argument("--experts-csv", default=str(ROOT / "benchmarks" / "results" / "moe_experts.csv"))
    args = ap.parse_args()
    if args.what in ("all", "router"):
        bench_router(args.tokens, args.experts, args.csv)
    if args.what in ("all", "experts"):
        bench_experts(args.layer, args.experts_csv)


if __name__ == "__main__":
    main()

"""Benchmark every kprof kernel against eager PyTorch, torch.compile and Liger Kernel, in one process.

    python benchmarks/bench_kernels.py [--only rms_norm,softmax] [--csv benchmarks/results/kernels.csv]

Method (the device README's METHOD.md): correctness is checked before anything is timed; each
timing is a median from `triton.testing.do_bench(..., return_mode="median")` (it warms up and
flushes L2 between repeats); the issue shapes are all larger than the H200's 60 MB L2. Three
times per implementation and mode, all in the CSV:
  median_us   do_bench of the Python call: wall time, host-bound on the lent VM for the short
              kernels (its CPU spends ~12 us per aten op; benchmarks/host_overhead.py)
  graph_us    one call captured in a CUDA graph, each replay timed alone: GPU time plus the
              graph's launch latency (~4-6 us per replay on the H200, 2026-11-30)
  graphn_us   `graph_calls` calls back to back in one graph, alternating between two input
              sets, replay time / calls (METHOD.md: "capture a graph and time its replays";
              triton.testing.do_bench_cudagraph does the same): the GPU time per call as a
              training step sees it, with the launch latency paid once per replay; the median
              of three do_bench medians, graphn_spread_us their range (the noise floor)
pct_copy_bw, pct_of_floor, gbps and meets_target use the first of graphn_us, graph_us,
median_us that was measured; `basis` names it. The copy bandwidth is measured in the same run
(a 2 GiB device-to-device copy, bytes read + written), and each kernel's floor is its minimal
bytes (from its KernelSpec.cost) over that bandwidth. Peak extra memory is the allocator's peak
during one forward+backward minus what was allocated before it.

Rows are appended to the CSV with GPU, versions and date; nothing in it is overwritten.

Reproduces: the kernel tables of the top README ("The kernel library": every kernel at 2026-11-30
03:52/04:04, cross-entropy and linear + cross-entropy at 07:19, e.g. cross-entropy fwd+bwd
1123.8 us, linear + CE 42.6 ms), every row of benchmarks/results/kernels.csv, and
benchmarks/results/bench-h200-20261130T0719-ce-lce.log. On the H200:
    python benchmarks/bench_kernels.py                                   (all cases, ~9 min)
    python benchmarks/bench_kernels.py --only cross_entropy,fused_linear_cross_entropy   (07:19)
or `bash benchmarks/gpu_run.sh bench` (BENCH_ONLY=... for a subset).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib
import math
import pkgutil
import platform
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CSV_FIELDS = [
    "date", "gpu", "torch", "triton", "liger", "kernel", "case", "impl", "mode",
    "median_us", "graph_us", "floor_us", "pct_of_floor", "gbps", "pct_copy_bw", "peak_extra_mb",
    "target_us", "meets_target", "max_rel_err", "note",
    # added 2026-11-30 (rows before have them empty): see the module docstring
    "graphn_us", "graph_calls", "basis", "graphn_spread_us",
]


def load_cases(only: set[str] | None):
    import benchmarks.cases as pkg

    cases = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"benchmarks.cases.{info.name}")
        for case in getattr(mod, "CASES", []):
            if only is None or case.kernel in only:
                cases.append(case)
    return cases


def copy_bandwidth_gbps() -> float:
    import triton.testing

    n = 1 << 30  # 2 GiB of bf16 per buffer: far past L2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    bw = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    del x, y
    torch.cuda.empty_cache()
    return bw


def bf16_matmul_tflops() -> float:
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def _outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _grad_leaves(inputs: dict):
    return [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _run_fwd_bwd(fn, inputs, grads):
    outs = [o for o in _outputs(fn(**inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
    torch.autograd.backward(outs, grads[: len(outs)])


def capture_graph(steps, leaves, calls: int) -> torch.cuda.CUDAGraph:
    """`calls` calls captured back to back in one CUDA graph, call i running steps[i % len(steps)],
    after three warm-up rounds on a side stream (what capture needs: allocations and lazy inits
    done). Each call first drops the grads of `leaves`, so a backward writes fresh grads and no
    accumulation kernel lands in the graph."""
    def clear():
        for t in leaves:
            t.grad = None

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for step in steps:
                clear()
                step()
    torch.cuda.current_stream().wait_stream(s)
    clear()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            clear()
            steps[i % len(steps)]()
    return g


def graph_time_us(steps, leaves, calls: int = 1) -> tuple[float, float]:
    """(median, spread of three medians) of the GPU time per call of `calls` calls captured back to back in one CUDA graph, call i
    running steps[i % len(steps)] (one step per input set): replay time / calls (METHOD.md).
    calls=1 is one call per replay, which also counts the graph's launch latency. do_bench's
    wall time can be host-bound on this machine's CPU (an aten op costs ~12 us of host time
    there; benchmarks/host_overhead.py)."""
    import triton.testing

    def clear():
        for t in leaves:
            t.grad = None

    # A callable that synchronizes with the host cannot be captured, and a failed capture leaves
    # the CUDA RNG unusable for the rest of the process (seen 2026-11-29 with Liger's CE). Probe
    # for syncs first, outside any capture.
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps:
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = capture_graph(steps, leaves, calls)
    # Three do_bench medians of the same graph: their spread is the noise floor of a comparison
    # (METHOD.md: a difference smaller than the spread of two timings of one version is noise).
    ts = sorted(triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e3 / calls
                for _ in range(3))
    del g
    clear()
    return ts[1], ts[2] - ts[0]


def graph_calls(single_us: float) -> int:
    """Calls per graph for graphn_us: ~2 ms of GPU work per replay (the launch latency, ~5 us,
    under 0.3% of it), at least 2 (both input sets), at most 32."""
    return max(2, min(32, math.ceil(2000.0 / max(single_us, 1.0))))


def _grad_like(t: torch.Tensor) -> torch.Tensor:
    """The incoming gradient for an output: 1 for a scalar loss (what loss.backward() passes;
    fused losses exploit it), fresh random data otherwise."""
    return torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(case, spec, inputs, impl_fn):
    """Max relative error (‖a-b‖/‖b‖) of forward outputs and input grads vs the fp32 reference."""
    ref_inputs = {
        k: (v.detach().float().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inputs.items()
    }
    ref_out = _outputs(spec.reference(**ref_inputs))
    out = _outputs(impl_fn(**inputs))
    errs = [_rel_err(o.float(), r) for o, r in zip(out, ref_out) if isinstance(o, torch.Tensor)]
    if case.backward:
        pairs = [(o, r) for o, r in zip(out, ref_out) if isinstance(o, torch.Tensor) and o.requires_grad]
        gs = [_grad_like(r) for _, r in pairs]
        torch.autograd.backward([r for _, r in pairs], gs)
        leaves = _grad_leaves(inputs)
        for t in leaves:
            t.grad = None
        torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for (o, _), g in zip(pairs, gs)])
        ref_leaves = [ref_inputs[k] for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        for t, r in zip(leaves, ref_leaves):
            if t.grad is not None and r.grad is not None:
                errs.append(_rel_err(t.grad.float(), r.grad))
            t.grad = None
    return max(errs) if errs else float("nan")


def bench_case(case, copy_bw_gbps, mm_tflops, versions, rows):
    import triton.testing

    from kprof.kernels import registry

    spec = registry.get(case.kernel)
    cost = spec.cost(**case.problem)
    fwd_bytes = cost["fwd"].bytes
    fb_bytes = cost["fwd"].bytes + cost["bwd"].bytes
    # Floor = the larger of bytes / copy bandwidth and FLOPs / bf16 matmul rate, both measured in
    # this run: memory-bound kernels hit the first, a fused linear+CE hits the second.
    def floor_us(c):
        return max(c.bytes / (copy_bw_gbps * 1e9), c.flops / (mm_tflops * 1e12)) * 1e6

    floors = {"fwd": floor_us(cost["fwd"]), "fwdbwd": floor_us(cost["fwd"] + cost["bwd"])}

    impls = {"kprof": case.kprof, **{f"kprof {k}": v for k, v in case.kprof_variants.items()}, "eager": case.eager}
    notes = {}
    try:
        impls["torch.compile"] = torch.compile(case.eager, dynamic=False)
    except Exception as e:  # noqa: BLE001 - a peer failing is a result, not a crash
        notes["torch.compile"] = f"unavailable: {e!r}"[:200]
    if case.liger is not None:
        try:
            impls["liger"] = case.liger()
        except Exception as e:  # noqa: BLE001
            notes["liger"] = f"unavailable: {e!r}"[:200]
    else:
        notes["liger"] = "no Liger equivalent"

    impls.update({f"kprof {k}": v for k, v in case.kprof_inplace_variants.items()})  # last: they clobber inputs
    inputs = case.make_inputs("cuda", torch.bfloat16)
    # A second input set: graphn_us alternates between the two, so no call reads what the one
    # before it left in L2 (the issue shapes are > L2 already; this makes it hold for any shape).
    inputs2 = case.make_inputs("cuda", torch.bfloat16)
    results = {}
    for name, fn in impls.items():
        try:
            err = check(case, spec, inputs, fn)
        except Exception as e:  # noqa: BLE001
            notes[name] = f"failed correctness run: {e!r}"[:200]
            traceback.print_exc()
            continue
        if name.startswith("kprof") and not err < 2e-2:
            # bf16 output vs fp32 reference: ~4e-3 expected (METHOD.md: 1e-3..1e-2); never time a wrong kernel
            notes[name] = f"WRONG: rel err {err:.3g} vs fp32 reference; not timed"
            print(f"!! {case.label}: kprof rel err {err:.3g}", flush=True)
            results[name] = {"err": err}
            continue
        r = {"err": err}

        def graphed(mode, steps, leaves):
            """graph_us and graphn_us of `steps` (one per input set) into r; a capture that fails
            (e.g. a peer that syncs) is a note, not a crash."""
            try:
                r[mode + "_graph"] = graph_time_us(steps[:1], leaves)[0]
                r[mode + "_calls"] = graph_calls(r[mode + "_graph"])
                r[mode + "_graphn"], r[mode + "_spread"] = graph_time_us(steps, leaves, r[mode + "_calls"])
            except Exception as e:  # noqa: BLE001
                notes[name] = (notes.get(name, "") + f" {mode} graph capture failed: {type(e).__name__}")[:200]
                torch.cuda.synchronize()

        leaves = _grad_leaves(inputs)
        leaves2 = _grad_leaves(inputs2)
        r["fwd"] = triton.testing.do_bench(lambda: fn(**inputs), warmup=25, rep=200, return_mode="median") * 1e3
        if case.backward:
            outs = [o for o in _outputs(fn(**inputs)) if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = [_grad_like(o) for o in outs]
            grads2 = [_grad_like(o) for o in outs]
            del outs
            r["fwdbwd"] = triton.testing.do_bench(
                lambda: _run_fwd_bwd(fn, inputs, grads), warmup=25, rep=200, grad_to_none=leaves, return_mode="median"
            ) * 1e3
            for t in leaves:
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _run_fwd_bwd(fn, inputs, grads)
            torch.cuda.synchronize()
            r["peak_extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            for t in leaves:
                t.grad = None
            graphed("fwdbwd", [lambda: _run_fwd_bwd(fn, inputs, grads), lambda: _run_fwd_bwd(fn, inputs2, grads2)],
                    leaves + leaves2)
            del grads, grads2
        graphed("fwd", [lambda: fn(**inputs), lambda: fn(**inputs2)], [])
        results[name] = r

    for name, r in results.items():
        for mode in ("fwd", "fwdbwd"):
            if mode not in r:
                continue
            basis = next(k for k in (mode + "_graphn", mode + "_graph", mode) if k in r)
            t_us = r[basis]
            nbytes = fwd_bytes if mode == "fwd" else fb_bytes
            target = case.targets_us.get(mode)

            def us(key):
                return round(r[key], 2) if key in r else ""

            rows.append({
                **versions,
                "kernel": case.kernel, "case": case.label, "impl": name, "mode": mode,
                "median_us": us(mode), "graph_us": us(mode + "_graph"),
                "graphn_us": us(mode + "_graphn"), "graph_calls": r.get(mode + "_calls", ""),
                "graphn_spread_us": us(mode + "_spread"),
                "basis": {mode: "median_us", mode + "_graph": "graph_us", mode + "_graphn": "graphn_us"}[basis],
                "floor_us": round(floors[mode], 2),
                "pct_of_floor": round(100 * floors[mode] / t_us, 1),
                "gbps": round(nbytes / (t_us * 1e-6) / 1e9, 1),
                "pct_copy_bw": round(100 * nbytes / (t_us * 1e-6) / 1e9 / copy_bw_gbps, 1),
                "peak_extra_mb": round(r.get("peak_extra_mb", float("nan")), 1) if mode == "fwdbwd" else "",
                "target_us": target if name == "kprof" and target is not None else "",
                "meets_target": (t_us <= target) if name == "kprof" and isinstance(target, (int, float)) else "",
                "max_rel_err": f"{r['err']:.3g}", "note": notes.get(name, ""),
            })
    for name, note in notes.items():
        if name not in results:
            rows.append({**versions, "kernel": case.kernel, "case": case.label, "impl": name, "mode": "",
                         "note": note})
    del inputs, inputs2
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated kernel names (registry names)")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "kernels.csv"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (timings on a CPU would mean nothing)", file=sys.stderr)
        return 2
    import triton

    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version

        liger_v = version("liger-kernel")
    except Exception:  # noqa: BLE001
        liger_v = "not installed"
    versions = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__, "liger": liger_v,
    }
    print(f"# {versions} python {platform.python_version()}", flush=True)
    bw = copy_bandwidth_gbps()
    mm = bf16_matmul_tflops()
    print(f"# measured copy bandwidth: {bw:.0f} GB/s; bf16 8192^3 matmul: {mm:.0f} TFLOP/s", flush=True)
    rows = [{**versions, "kernel": "copy", "case": "device copy 2 GiB bf16", "impl": "torch", "mode": "copy",
             "gbps": round(bw, 1), "pct_copy_bw": 100.0},
            {**versions, "kernel": "matmul", "case": "bf16 8192^3 matmul (TFLOP/s in gbps column)", "impl": "torch",
             "mode": "matmul", "gbps": round(mm, 1)}]
    only = set(args.only.split(",")) if args.only else None
    for case in load_cases(only):
        print(f"## {case.label}", flush=True)
        try:
            bench_case(case, bw, mm, versions, rows)
        except Exception as e:  # noqa: BLE001 - keep going; the row says what failed
            traceback.print_exc()
            rows.append({**versions, "kernel": case.kernel, "case": case.label, "impl": "kprof", "mode": "",
                         "note": f"benchmark crashed: {e!r}"[:200]})
        _flush(rows, Path(args.csv))  # partial results are saved as we go
        rows = []
    _print_table(Path(args.csv), versions["date"])
    return 0


def _flush(rows, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _upgrade_header(path)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in CSV_FIELDS})


def _upgrade_header(path: Path) -> None:
    """Columns are only ever appended to CSV_FIELDS: give an older file the new header line, its
    rows untouched (shorter rows read back with the new columns empty)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    old = next(csv.reader(lines[:1]), [])
    if old == CSV_FIELDS:
        return
    if old != CSV_FIELDS[: len(old)]:
        raise SystemExit(f"{path}: its columns {old} are not a prefix of this script's {CSV_FIELDS}; "
                         "write to a new file with --csv")
    lines[0] = ",".join(CSV_FIELDS) + "\n"
    path.write_text("".join(lines))


def _print_table(path: Path, date: str) -> None:
    import pandas as pd

    df = pd.read_csv(path)
    df = df[(df["date"] == date) & df["mode"].isin(["fwd", "fwdbwd"])]
    if df.empty:
        return
    # GPU time per call in a graph of back-to-back calls, per implementation; then kprof's other
    # two timings (single replay, do_bench wall time) and the floor/target columns.
    piv = df.pivot_table(index=["case", "mode"], columns="impl", values="graphn_us", aggfunc="first")
    k = df[df["impl"] == "kprof"].set_index(["case", "mode"])
    extra = k[["graphn_spread_us", "graph_us", "median_us", "floor_us", "pct_copy_bw", "target_us", "meets_target"]].rename(
        columns={"graphn_spread_us": "kprof spread", "graph_us": "kprof 1/replay", "median_us": "kprof do_bench"})
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print("GPU us per call, back-to-back in a CUDA graph (graphn_us); pct_copy_bw and meets_target from it")
        print(piv.join(extra).round(1).to_string())


if __name__ == "__main__":
    raise SystemExit(main())

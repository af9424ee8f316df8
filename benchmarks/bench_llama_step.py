"""Training-step benchmark of the Llama example: eager vs kprof patches vs torch.compile vs Liger.

    python benchmarks/bench_llama_step.py [--preset 1b] [--steps 20] [--variants eager,kprof,compile,liger]
                                          [--csv benchmarks/results/llama_step.csv]

Each variant runs in its own process (so peak memory is its own) on the same model shape, data
and seed as examples/llama_train.py: forward with labels, backward, fused AdamW, zero_grad.
Step time: CUDA events at each step boundary, median over the steps after `--warmup` (the first
steps hold compilation, autotuning and, for kprof, the first-call verification). Peak memory:
torch.cuda.max_memory_allocated over the timed steps, after a reset at the end of warm-up.
Rows are appended to the CSV with GPU, versions and date.

Reproduces: the 1B Llama step of the top README's Status table (2026-11-30 06:38: kprof 73.1 ms vs
Liger 80.6 ms, both 11.03 GiB; earlier runs in docs/results.md), the rows of
benchmarks/results/llama_step.csv and benchmarks/results/llama-step-h200-20261130T0638.log:
    python benchmarks/bench_llama_step.py --variants kprof,liger          (H200, ~3 min)
and, with `--variants eager,kprof,liger --memory-peak`, the memory-peak-1b-*.json files
(benchmarks/memory_peak.py). `bash benchmarks/gpu_run.sh step` runs the first.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import inspect
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ["date", "gpu", "torch", "triton", "transformers", "liger", "preset", "variant", "step_ms_median",
          "step_ms_p10", "step_ms_p90", "speedup_vs_eager", "peak_mem_gib", "tokens_per_s", "first_losses", "note"]


def run_variant(variant: str, preset: str, steps: int, warmup: int, memory_peak: bool = False) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import llama_train  # the example's own presets and model builder

    cfg = llama_train.PRESETS[preset]
    device = torch.device("cuda")
    dtype = getattr(torch, cfg["dtype"])
    note = ""
    if variant in ("liger",):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()  # patches the HF Llama classes before the model is built
    torch.manual_seed(0)
    model = llama_train.build_model(preset, device, dtype)
    model.train()
    if variant.startswith("kprof"):
        import kprof

        kprof.patch(model, rules="all")
        note = "patched (verified at first call; reverted ones are listed by kprof's warning)"
    if variant.endswith("compile"):
        model = torch.compile(model)
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {}))
    input_ids = torch.randint(0, model.config.vocab_size, (cfg["batch_size"], cfg["seq_len"]), device=device)

    events, losses = [], []
    mem = None

    def one_step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    for step in range(steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if memory_peak and step == max(warmup - 1, 0):
            # The last warm-up step, steady state, outside the timed steps (recording slows it).
            sys.path.insert(0, str(ROOT))
            from benchmarks.memory_peak import record_step

            mem = record_step(one_step)
        else:
            one_step()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in zip(events[warmup:], events[warmup + 1:])]
    q = statistics.quantiles(times, n=10)
    return {
        "variant": variant, "step_ms_median": statistics.median(times), "step_ms_p10": q[0], "step_ms_p90": q[-1],
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "tokens_per_s": cfg["batch_size"] * cfg["seq_len"] / (statistics.median(times) / 1e3),
        "first_losses": [round(float(x), 4) for x in losses[:5]], "note": note,
        **({"memory_peak": mem} if mem is not None else {}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default="eager,kprof,compile,liger,kprof+compile")
    ap.add_argument("--csv", default=str(ROOT / "benchmarks" / "results" / "llama_step.csv"))
    ap.add_argument("--memory-peak", action="store_true",
                    help="record one warm-up step's allocations and list what is alive at its peak, by site "
                         "(benchmarks/memory_peak.py); written beside the CSV")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, args.preset, args.steps, args.warmup, args.memory_peak)),
              flush=True)
        return 0

    import torch
    import transformers
    import triton

    try:
        from importlib.metadata import version

        liger_v = version("liger-kernel")
    except Exception:  # noqa: BLE001
        liger_v = "not installed"
    meta = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "liger": liger_v, "preset": args.preset}
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)

    def append(row: dict) -> None:
        new = not path.exists()
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerow({k: (json.dumps(row[k]) if isinstance(row.get(k), list) else row.get(k, "")) for k in FIELDS})

    rows: list[dict] = []
    eager = None
    for v in args.variants.split(","):
        p = subprocess.run([sys.executable, __file__, "--one", v, "--preset", args.preset, "--steps", str(args.steps),
                            "--warmup", str(args.warmup)] + (["--memory-peak"] if args.memory_peak else []),
                           capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            err = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            print(f"{v}: FAILED: {err}\n{p.stderr[-2000:]}", flush=True)
            rows.append({**meta, "variant": v, "note": f"failed: {err}"})
            append(rows[-1])
            continue
        r = json.loads(line[-1][len("RESULT "):])
        mem = r.pop("memory_peak", None)
        if mem is not None:
            out = path.with_name(f"memory-peak-{args.preset}-{v.replace('+', '_')}-{meta['date'].replace(':', '')}.json")
            out.write_text(json.dumps({**meta, "variant": v, **mem}, indent=1))
            print(f"{v}: {mem['base_bytes'] / 2**30:.2f} GiB before the step, peak +{mem['peak_bytes'] / 2**30:.2f} GiB; "
                  f"alive at the peak, by site ({out.name}):", flush=True)
            for site_row in mem["sites"][:12]:
                print(f"  {site_row['bytes'] / 2**20:9.1f} MiB  {site_row['blocks']:4d} blocks  {site_row['site']}", flush=True)
        if v == "eager":
            eager = r["step_ms_median"]
        if eager:
            r["speedup_vs_eager"] = round(eager / r["step_ms_median"], 3)
        rows.append({**meta, **r})
        append(rows[-1])
        print(f"{v:15s} {r['step_ms_median']:8.1f} ms  peak {r['peak_mem_gib']:6.2f} GiB  losses {r['first_losses']}  {r['note']}", flush=True)
    print(f"{'variant':15s} {'ms/step':>8s} {'x eager':>8s} {'peak GiB':>9s}")
    for r in rows:
        if "step_ms_median" in r:
            print(f"{r['variant']:15s} {r['step_ms_median']:8.1f} {r.get('speedup_vs_eager', float('nan')):8.2f} {r['peak_mem_gib']:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 25 on 2 GPUs (nvidia-h200-x2; NOT RUN YET: that kind was withheld when this was
written): the 1B-class Llama under DDP and FSDP2, unprofiled and under `kprof profile
--nproc-per-node 2`, one JSON of what kprof measured per rank.

    python benchmarks/bench_multi_gpu.py --out $OUT [--nproc 2] [--tiny]

Per wrap it records: the unprofiled torchrun wall time (the profiler's overhead is kprof's step
time against it), and from the merged run: per-rank step medians, skew, slowest rank,
straggler, communication ms/step, exposed and overlapped. Bus bandwidth against a measured
NVLink all-reduce ceiling is NOT measured yet (`kprof calibrate` has no all-reduce probe).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks" / "workloads" / "llama_distributed.py"

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--nproc", type=int, default=2)
p.add_argument("--tiny", action="store_true", help="CPU smoke run (gloo)")
args = p.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
extra = ["--tiny"] if args.tiny else []
results = {}
for wrap in ("ddp", "fsdp"):
    wl = [str(WORKLOAD), "--wrap", wrap, *extra]
    t0 = time.perf_counter()
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.nproc}", *wl], capture_output=True, text=True)
    plain_s = time.perf_counter() - t0
    runs = out / f"runs-{wrap}"
    prof = subprocess.run([sys.executable, "-m", "kprof", "profile", wl[0], "--out", str(runs),
                           "--nproc-per-node", str(args.nproc), "--", *wl[1:]], capture_output=True, text=True)
    (out / f"profile-{wrap}.log").write_text(prof.stdout + prof.stderr)
    merged = [json.loads((r / "summary.json").read_text()) for r in runs.iterdir()
              if not r.name.startswith(".") and (r / "summary.json").exists()] if runs.exists() else []
    results[wrap] = {"plain rc": plain.returncode, "plain wall s": plain_s, "kprof rc": prof.returncode,
                     "distributed": merged[0].get("distributed") if merged else None,
                     "communication rank0": merged[0].get("communication") if merged else None}
(out / "multi_gpu.json").write_text(json.dumps(results, indent=1))
print(json.dumps(results, indent=1))

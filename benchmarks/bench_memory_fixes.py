"""Issue 28 on the GPU: kprof's memory fixes against the usual ones. NOT RUN YET (written
2026-12-02 after that day's H200 time was spent); nothing in benchmarks/results comes from it.

    python benchmarks/bench_memory_fixes.py --out DIR [--only ckpt,batch] [--timeout 300]
                                            [--script-args ARGS]

ckpt, the 1B-class Llama (examples/llama_train.py --preset 1b), each in its own processes:
  - `kprof profile`: the eager step (unprofiled median) and its peak (max_memory_allocated);
  - `kprof apply --patch activation_checkpointing --prefer memory --keep-losers --json` on that
    run: the layers kprof picks (most saved bytes per recompute ms first), the peak before and
    after and the step-time cost, from apply's ablation;
  - `kprof profile ... --checkpoint-every-layer`: Hugging Face's gradient checkpointing on every
    layer, the usual fix, profiled the same way.
batch, GPT-2 small (examples/gpt_train.py: 12 layers, 768 wide, 12 heads) at sequence 1024, bf16:
  `kprof apply --prefer memory --json`: the largest batch that fits before and after the kept
  patches (its `largest_batch` field, searched between the last timed steps, CUDA only).
Results: DIR/memory-fixes-<date>.json (every kprof document) and .md (the figures the issue
asks for), rewritten after each part, so a cut run keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
from pathlib import Path

from bench_apply_ablation import choose, kprof  # run as a script: benchmarks/ is on the path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "llama_train.py"
GPT = ROOT / "examples" / "gpt_train.py"
GIB = 2**30


def _json(p: subprocess.CompletedProcess) -> dict:
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {p.stderr.strip()[-1500:]}"}
    return json.loads(p.stdout[p.stdout.index("{"):])


def profiled(script: Path, root: Path, argv: list[str], timeout: float) -> dict:
    """`kprof profile` then its summary: step median (unprofiled) and peak memory."""
    p = kprof(["profile", script, "--out", root, "--warmup", "3", "--steps", "5", "--", *argv], timeout)
    if p.returncode != 0:
        return {"error": f"profile exit {p.returncode}: {p.stderr.strip()[-1500:]}"}
    from kprof import store

    run = Path(store.list_runs(root)[-1])
    s = json.loads((run / "summary.json").read_text())
    return {"run": run.name, "step_ms": (s.get("step_time_ms") or {}).get("median"),
            "peak_bytes": s.get("peak_memory_bytes")}


def ckpt(out: Path, timeout: float, extra: list[str]) -> dict:
    argv = ["--preset", "1b", "--device", "cuda", "--steps", "400", *extra]
    root = out / "runs" / "ckpt"
    res = {"eager": profiled(LLAMA, root, argv, timeout)}
    if "run" in res["eager"]:
        res["kprof"] = _json(kprof(["apply", LLAMA, "--run", root / res["eager"]["run"], "--out", root,
                                    "--patch", "activation_checkpointing", "--prefer", "memory", "--keep-losers",
                                    "--json", "--", *argv], timeout))
    res["every_layer"] = profiled(LLAMA, out / "runs" / "ckpt_all", [*argv, "--checkpoint-every-layer"], timeout)
    return res


def batch(out: Path, timeout: float, extra: list[str]) -> dict:
    argv = ["--device", "cuda", "--dtype", "bfloat16", "--seq-len", "1024", "--batch-size", "8", "--steps", "400",
            *extra]
    root = out / "runs" / "batch"
    p = kprof(["profile", GPT, "--out", root, "--warmup", "3", "--steps", "5", "--", *argv], timeout)
    if p.returncode != 0:
        return {"error": f"profile exit {p.returncode}: {p.stderr.strip()[-1500:]}"}
    return {"kprof": _json(kprof(["apply", GPT, "--out", root, "--prefer", "memory", "--json", "--", *argv],
                                 timeout))}


def _gib(v) -> str:
    return "?" if not isinstance(v, (int, float)) else f"{v / GIB:.2f} GiB"


def _ms(v) -> str:
    return "?" if not isinstance(v, (int, float)) else f"{v:.1f} ms"


def markdown(res: dict, when: str) -> str:
    out = [f"# kprof memory fixes (issue 28), {when}", ""]
    c = res.get("ckpt")
    if c:
        out.append("## 1B Llama: activation checkpointing")
        e, a = c.get("eager", {}), c.get("every_layer", {})
        out.append(f"- eager: step {_ms(e.get('step_ms'))}, peak {_gib(e.get('peak_bytes'))}"
                   + (f" ({e['error']})" if "error" in e else ""))
        k = c.get("kprof") or {}
        if "error" in k:
            out.append(f"- kprof's pick: {k['error'].splitlines()[-1]}")
        elif k:
            pm = k.get("peak_memory") or {}
            layers = [p.get("where") for p in k.get("patches", []) if p.get("id") == "activation_checkpointing"]
            out.append(f"- kprof's pick ({', '.join(map(str, layers)) or 'none'}): step {_ms(k.get('before_ms'))} -> "
                       f"{_ms(k.get('after_ms'))}, peak {json.dumps(pm)}")
        out.append(f"- every layer: step {_ms(a.get('step_ms'))}, peak {_gib(a.get('peak_bytes'))}"
                   + (f" ({a['error']})" if "error" in a else ""))
        out.append("")
    b = res.get("batch")
    if b:
        k = b.get("kprof") or {}
        out.append("## GPT-2 small, sequence 1024: largest batch")
        out.append(f"- {json.dumps(k.get('largest_batch')) if 'error' not in k else k['error'].splitlines()[-1]}")
        out.append(f"- kept: {', '.join(k.get('kept') or []) or 'none'}")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="ckpt,batch", help="comma-separated: ckpt, batch")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per kprof call")
    ap.add_argument("--script-args", default="", help="appended to the scripts' arguments (a CPU smoke run)")
    args = ap.parse_args()
    parts = {"ckpt": ckpt, "batch": batch}
    names = choose(args.only, parts, "part(s)")
    args.out.mkdir(parents=True, exist_ok=True)
    when = dt.datetime.now().strftime("%Y%m%dT%H%M%S")
    res: dict = {}
    for n in names:
        try:
            res[n] = parts[n](args.out, args.timeout, args.script_args.split())
        except subprocess.TimeoutExpired as e:
            res[n] = {"error": f"timed out after {e.timeout:.0f} s"}
        (args.out / f"memory-fixes-{when}.json").write_text(json.dumps(res, indent=1, default=str))
        (args.out / f"memory-fixes-{when}.md").write_text(markdown(res, when))
    print(markdown(res, when))


if __name__ == "__main__":
    main()

"""Issue 27 measurement: how much of a compiled model's GPU time kprof attributes to modules.

NOT YET RUN (written 2026-12-02 without GPU time; the numbers go to benchmarks/results when it
runs on the H200). Run there, from the repository root, after `pip install -e .`:

    python benchmarks/compiled_attribution.py [--steps 5] [--out DIR]

For each workload, a compiled ~150M HF Llama (benchmarks/workloads/hf_llama_150m.py) and a
nanoGPT-style GPT (examples/gpt_train.py --dtype bfloat16), it profiles the script eager and
under torch.compile (default mode; a small wrapper compiles the model the script builds, so the
scripts stay unmodified) and prints:
- the compiled run's Inductor kernel time and the share attributed below the root module and
  costed (the issue's target: >= 95% attributed);
- the share of all device time in the step with a module (or <optimizer>), both runs;
- the top 10 modules by device time with their classes' shares, eager beside compiled;
- the graph breaks and recompiles kprof found (expected: none).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WRAPPERS = {
    "hf_llama_150m": ("benchmarks/workloads/hf_llama_150m.py", [], textwrap.dedent("""\
        import runpy, sys, torch, transformers
        _L = transformers.LlamaForCausalLM
        transformers.LlamaForCausalLM = lambda cfg: torch.compile(_L(cfg))
        sys.argv[0] = {script!r}
        runpy.run_path({script!r}, run_name="__main__")
        """)),
    "gpt_train": ("examples/gpt_train.py", ["--dtype", "bfloat16", "--batch-size", "16", "--seq-len", "1024"],
                  textwrap.dedent("""\
        import sys, torch
        sys.path.insert(0, {dir!r})
        import gpt_train
        _G = gpt_train.GPT
        gpt_train.GPT = lambda cfg: torch.compile(_G(cfg))
        gpt_train.main(sys.argv[1:])
        """)),
}


def module_table(run):
    import pandas as pd

    from kprof.analyze.compiled import kernel_name

    ops = run.ops
    t = pd.to_numeric(ops["device_time (us)"], errors="coerce").fillna(0.0)
    total = float(t.sum()) or 1.0
    placed = ~ops["module"].isin(["", "<unattributed>"])
    by = ops.assign(t=t).groupby(["module", "class"])["t"].sum().unstack(fill_value=0.0)
    top = by.sum(axis=1).nlargest(10)
    is_k = ops["op"].map(kernel_name).notna()
    return float(t[placed].sum() / total), by.loc[top.index].div(by.loc[top.index].sum(axis=1), axis=0), int(is_k.sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=".kprof/runs")
    args = ap.parse_args()
    from kprof.analyze.profile import profile_script

    with tempfile.TemporaryDirectory() as d:
        for name, (script, extra, wrapper) in WRAPPERS.items():
            path = str(ROOT / script)
            w = Path(d) / f"{name}_compiled.py"
            w.write_text(wrapper.format(script=path, dir=str(Path(path).parent)))
            argv = ["--steps", "40", *extra] if name == "hf_llama_150m" else ["--steps", "40", *extra]
            eager = profile_script(path, argv, warmup=3, steps=args.steps, out_root=args.out)
            comp = profile_script(str(w), argv, warmup=3, steps=args.steps, out_root=args.out)
            c = comp.summary.get("compile") or {}
            att = c.get("attribution") or {}
            print(f"== {name}: eager {eager.path.name}, compiled {comp.path.name}")
            print(f"compiled: {c.get('kernel_records', 0)} kernel records, Inductor kernel time "
                  f"{att.get('kernel_us', 0) / 1e3:.1f} ms, attributed {100 * att.get('attributed', float('nan')):.1f}%, "
                  f"costed {100 * att.get('costed', float('nan')):.1f}%")
            for label, run in (("eager", eager), ("compiled", comp)):
                share, table, n_k = module_table(run)
                print(f"{label}: {100 * share:.1f}% of device time has a module; {n_k} Inductor kernel rows")
                print((100 * table).round(1).to_string())
            print("graph breaks:", c.get("graph_breaks"), "recompiles:", c.get("recompiles"))


if __name__ == "__main__":
    main()

"""Record the compiled-model fixture: a tiny HF Llama under torch.compile (Inductor, CPU), its
trace and the kernel records kprof keeps at compile time (kprof/capture/compiled.py).

    python tests/data/make_compiled_trace.py   # rewrites tests/data/compiled_llama_cpu*.json.gz

Only the root gets a `kprof.module:` range, as under the runner: compiled graphs run no module
hooks, which is why the kernels need the compile-time records. torch 2.13.0, CPU.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from torch.profiler import record_function

sys.path.insert(0, str(Path(__file__).parent))
from make_traces import HERE, record, tiny_llama  # noqa: E402

from kprof.capture.compiled import KernelRecorder  # noqa: E402

TRACE = HERE / "compiled_llama_cpu.json.gz"
KERNELS = HERE / "compiled_llama_cpu_kernels.json.gz"


def main() -> None:
    rec = KernelRecorder()
    rec.start()
    try:
        model, eager_step = tiny_llama()
        compiled = torch.compile(model)
        ids = torch.randint(0, 128, (2, 16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

        def step():
            with record_function("kprof.module::LlamaForCausalLM"):
                out = compiled(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        class _NoHooks(torch.nn.Module):  # record() only reads .parameters() from its root
            def __init__(self):
                super().__init__()
                self.m = model

        import make_traces

        make_traces.module_ranges = lambda root: __import__("contextlib").nullcontext()
        print(record(_NoHooks(), step, 2, TRACE))
    finally:
        rec.stop()
    with gzip.open(KERNELS, "wt") as f:
        json.dump(rec.kernels, f)
    print(KERNELS, len(rec.kernels), "kernel records", rec.warnings)


if __name__ == "__main__":
    sys.exit(main())

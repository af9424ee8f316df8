"""Record the small CPU traces the profile tests read, with kprof's range names emitted by hand.

The runner (kprof/capture/runner.py) emits `kprof.step#<n>` and `kprof.module:<path>:<Class>` ranges;
here the same names come from a few lines of hooks, so the trace/analysis tests do not depend on
the runner. The tests also call `record()` live (a fresh trace from the installed torch); the
checked-in files pin one torch version's format (torch 2.13.0, CPU):

    python tests/data/make_traces.py     # rewrites tests/data/*.json.gz
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).parent


@contextlib.contextmanager
def module_ranges(root: nn.Module):
    """`kprof.module:<path>:<Class>` around every forward of `root`'s modules (global hooks)."""
    paths = {id(m): name for name, m in root.named_modules()}
    open_: list = []

    def pre(mod, args):
        if id(mod) in paths:
            rf = record_function(f"kprof.module:{paths[id(mod)]}:{type(mod).__name__}")
            rf.__enter__()
            open_.append(rf)

    def post(mod, args, out):
        if id(mod) in paths and open_:
            open_.pop().__exit__(None, None, None)

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def record(root: nn.Module, step: Callable[[], None], steps: int, path: str | os.PathLike, warmup: int = 1) -> str:
    """Run `step` warmup + steps times, profiling the last `steps` inside kprof.step#<n> ranges;
    write the Chrome trace to `path` (gzipped if it ends in .gz)."""
    for _ in range(warmup):
        step()
    # CUDA activity too when the model is on a GPU: without it a GPU trace has no kernels and
    # reads as a CPU-only trace.
    activities = [ProfilerActivity.CPU]
    if any(p.is_cuda for p in root.parameters()):
        activities.append(ProfilerActivity.CUDA)
    with module_ranges(root), profile(activities=activities, record_shapes=True) as prof:
        for n in range(steps):
            with record_function(f"kprof.step#{n}"):
                step()
        if ProfilerActivity.CUDA in activities:
            torch.cuda.synchronize()  # the last step's kernels complete inside the recording
    path = str(path)
    if path.endswith(".gz"):
        with tempfile.TemporaryDirectory() as d:
            raw = os.path.join(d, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as f, gzip.open(path, "wb") as g:
                shutil.copyfileobj(f, g)
    else:
        prof.export_chrome_trace(path)
    return path


class MLP(nn.Module):
    """Linear -> GELU -> Linear with LayerNorm: small, with known FLOPs (2*M*N*K per Linear)."""

    def __init__(self, d: int = 32, h: int = 64):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.norm(x))))


def mlp_step(batch: int = 8, d: int = 32, h: int = 64):
    torch.manual_seed(0)
    model = MLP(d, h)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(batch, d)

    def step():
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def tiny_llama(vocab: int = 128, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               batch: int = 2, seq: int = 16, fused_adam: bool = False):
    """A tiny transformers.LlamaForCausalLM (built from a config, no download) + AdamW step."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=4 * seq)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if fused_adam else {"foreach": True}))
    ids = torch.randint(0, vocab, (batch, seq))

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def main() -> None:
    model, step = mlp_step()
    print(record(model, step, 2, HERE / "mlp_cpu.json.gz"))
    model, step = tiny_llama()
    print(record(model, step, 2, HERE / "llama_cpu.json.gz"))


if __name__ == "__main__":
    sys.exit(main())

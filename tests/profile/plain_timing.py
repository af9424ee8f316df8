"""Independent step timing for the GPU acceptance test: no kprof code involved.

    python tests/profile/plain_timing.py OUT.json SCRIPT [script args]

Runs SCRIPT as __main__ with a global optimizer step post-hook that records a CUDA event at each
step boundary, then writes the step times (ms, between consecutive boundaries) as JSON.
"""

import json
import runpy
import sys

import torch

# `from ... import`, not the attribute: torch 2.11's torch/optim/__init__.py deletes the submodule
# names from its namespace, so `torch.optim.optimizer` raises AttributeError there (H200, 2026-11-29).
from torch.optim.optimizer import register_optimizer_step_post_hook

out, script, *args = sys.argv[1:]
events: list = []


def _hook(opt, a, kw):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    events.append(e)


register_optimizer_step_post_hook(_hook)
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    if e.code not in (0, None):
        raise
torch.cuda.synchronize()
times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
with open(out, "w") as f:
    json.dump(times, f)

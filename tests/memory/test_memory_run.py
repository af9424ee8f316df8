"""The memory record end to end: a CPU run of a tiny MLP, and a tiny HF Llama on the GPU (the
categories against torch.cuda.max_memory_allocated)."""

import pytest

from kprof import store
from kprof.analyze.profile import profile_script

SCRIPT = '''
import sys
import torch
from torch import nn
dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(dev)
opt = torch.optim.AdamW(m.parameters())
for i in range(12):
    loss = m(torch.randn(32, 64, device=dev)).square().mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=False)
'''


@pytest.mark.slow
def test_cpu_run_records_memory(tmp_path):
    script = tmp_path / "mlp.py"
    script.write_text(SCRIPT)
    run = profile_script(str(script), [], warmup=1, steps=2, out_root=tmp_path / "runs")
    m = run.summary["memory"]
    n_params = 64 * 256 + 256 + 256 * 64 + 64
    assert m["categories_sum"] == m["peak_bytes"]
    assert m["categories"]["parameters"] == 4 * n_params
    assert m["categories"]["optimizer state"] == 2 * 4 * n_params  # exp_avg, exp_avg_sq
    assert m["tensors"]["gradients_at_forward_start"]["bytes"] == 4 * n_params  # set_to_none=False
    assert store.load_memory(run.path)["events"]
    from kprof.rules.diagnoses import memory as diag

    assert diag.find_grads_alive(run.ops, run.summary)[0].source.endswith("mlp.py:11")


@pytest.mark.gpu
def test_llama_categories_sum_to_max_memory_allocated(tmp_path):
    """The issue's target: the categories within 5% of torch.cuda.max_memory_allocated (tiny
    Llama here; the 1B-class run is the benchmark)."""
    import pathlib

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama_train.py"
    run = profile_script(str(example), ["--preset", "tiny", "--device", "cuda"], warmup=2, steps=2,
                         out_root=tmp_path / "runs")
    m = run.summary["memory"]
    assert m["max_allocated"], m.get("source")
    assert abs(m["categories_sum"] - m["max_allocated"]) <= 0.05 * m["max_allocated"]
    assert m["categories"]["parameters"] > 0 and m["categories"]["optimizer state"] > 0
    assert (run.path / store.MEMORY_SNAPSHOT).is_file()
    assert m["peak_moment"] != "outside the step"

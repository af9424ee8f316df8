"""Memory diagnoses (rules/diagnoses/memory.py) on planted memory sections and op tables."""

import math

import pandas as pd

from kprof.rules.diagnoses import memory as diag

MiB = 1 << 20
GiB = 1 << 30


def _mem(**over):
    m = {"peak_bytes": 10 * GiB, "peak_phase": "backward", "peak_moment": "backward of model.layers.1",
         "categories": {"parameters": 2 * GiB, "gradients": GiB, "optimizer state": 2 * GiB,
                        "activations": 4 * GiB, "temporaries": GiB, "other (before the step)": 0},
         "activations_saved": [
             {"module": "model.layers.0.mlp", "layer": "model.layers.0", "bytes": GiB, "blocks": 4},
             {"module": "model.layers.0.attn", "layer": "model.layers.0", "bytes": GiB, "blocks": 4},
             {"module": "model.layers.1.mlp", "layer": "model.layers.1", "bytes": GiB, "blocks": 4},
             {"module": "lm_head", "layer": "lm_head", "bytes": GiB // 2, "blocks": 1}],
         "tensors": {"parameters": {"bytes": 2 * GiB, "count": 3, "by_dtype": {"float32": 2 * GiB}},
                     "gradients": {"bytes": GiB, "count": 3, "by_dtype": {"float32": GiB}},
                     "optimizer_state": {"bytes": 2 * GiB, "count": 6, "by_dtype": {"float32": 2 * GiB}},
                     "gradients_at_forward_start": {"bytes": 0, "count": 0, "by_dtype": {}}},
         "reserved_bytes": 12 * GiB, "fragmentation_bytes": 2 * GiB}
    return m | over


def _ops():
    # model.layers.0's forward takes 2 ms/step, model.layers.1's 4 ms (2 steps recorded).
    return pd.DataFrame({"step": [0, 1, 0, 1], "phase": ["fwd"] * 4, "op": ["aten::mm"] * 4,
                         "module": ["model.layers.0.mlp", "model.layers.0.mlp", "model.layers.1.mlp", "model.layers.1.mlp"],
                         "device time (us)": [2000.0, 2000.0, 4000.0, 4000.0],
                         "input_shapes": [[[8, 8]]] * 4, "dtype": ["fp32"] * 4})


def test_checkpointing_ranks_layers_by_bytes_per_recompute_ms():
    (f,) = diag.find_checkpointing(_ops(), {"memory": _mem(), "steps_recorded": 2})
    layers = f.details[0]["layers"]
    assert [r["layer"] for r in layers] == ["model.layers.0", "model.layers.1"]  # 1 GiB/ms before 0.25
    assert f.details[0]["saving_bytes"] == 3 * GiB
    assert math.isclose(f.details[0]["time_cost_ms"], 6.0)
    assert math.isclose(f.saving_ms, -6.0)


def test_checkpointing_not_proposed_for_a_peak_in_the_optimizer():
    assert diag.find_checkpointing(_ops(), {"memory": _mem(peak_phase="optimizer"), "steps_recorded": 2}) == []


def test_large_vocab_logits():
    def ops(vocab):
        row = pd.DataFrame([{"step": 0, "phase": "fwd", "op": "aten::_log_softmax", "module": "",
                             "device time (us)": 1.0, "input_shapes": [[4096, vocab]], "dtype": "bf16"}])
        return pd.concat([_ops(), row], ignore_index=True)

    (f,) = diag.find_logits(ops(128256), {"memory": _mem()})
    assert f.details[0]["saving_bytes"] == 2 * 4096 * 128256 * 4
    assert diag.find_logits(ops(1000), {"memory": _mem()}) == []


def test_fp32_state_halves_the_state():
    (f,) = diag.find_fp32_state(_ops(), {"memory": _mem()})
    assert f.details[0]["saving_bytes"] == GiB  # no autocast: half the 2 GiB of state
    bf16 = _ops().assign(dtype="bf16")
    (g,) = diag.find_fp32_state(bf16, {"memory": _mem()})
    assert g.details[0]["saving_bytes"] == GiB + (2 * GiB + GiB) // 2  # plus the master weights and grads


def test_grads_kept_alive_from_the_memory_and_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nopt = None\nopt.zero_grad(set_to_none=False)\n")
    t = _mem()["tensors"] | {"gradients_at_forward_start": {"bytes": GiB, "count": 3, "by_dtype": {"float32": GiB}}}
    (f,) = diag.find_grads_alive(None, {"memory": _mem(tensors=t), "script": str(script)})
    assert f.source.endswith("train.py:3")
    assert f.details[0]["saving_bytes"] == GiB
    assert diag.find_grads_alive(None, {"memory": _mem(), "script": str(tmp_path / "none.py")}) == []


def test_fragmentation_over_a_tenth_of_reserved():
    (f,) = diag.find_fragmentation(None, {"memory": _mem()})
    assert f.details[0]["saving_bytes"] == 2 * GiB
    assert diag.find_fragmentation(None, {"memory": _mem(fragmentation_bytes=MiB * 100)}) == []


def test_no_memory_section_no_findings():
    for d in diag.DIAGNOSES:
        assert d.find(_ops(), {}) == []

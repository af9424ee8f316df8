"""MoE recognition on live models (kprof.rules.moe): Hugging Face MoE families from tiny
configs, hand-written blocks in other styles, and what must not match."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_models import DenseMaskMoE, GatedMLP, LoopMoE, MixtureNoTopK, hf_model  # noqa: E402

from kprof.rules.moe import find_moe, match  # noqa: E402

# arch -> (experts, top-k, score, shared experts, group-limited)
HF = {
    "mixtral": (4, 2, "softmax", [], None),
    "qwen2_moe": (8, 2, "softmax", ["shared_expert", "shared_expert_gate"], None),
    "olmoe": (8, 2, "softmax", [], None),
    "deepseek_v3": (8, 2, "sigmoid", ["shared_experts"], {"groups": 4, "groups_kept": 2}),
}


# Qwen2-MoE and OLMoE route as Mixtral does (softmax top-k, stacked experts): slow cases.
@pytest.mark.parametrize("arch", [a if a in ("mixtral", "deepseek_v3") else pytest.param(a, marks=pytest.mark.slow)
                                  for a in HF])
def test_hf_moe_blocks_recognised(arch):
    m = hf_model(arch)
    found = find_moe(m)
    n, k, score, shared, groups = HF[arch]
    # DeepSeek's layer 0 is a dense gated MLP (first_k_dense_replace=1): only layer 1 is MoE.
    layers = [1] if arch == "deepseek_v3" else [0, 1]
    assert [d["path"] for d in found] == [f"model.layers.{i}.mlp" for i in layers]
    for d in found:
        assert (d["num_experts"], d["top_k"], d["score"], d["shared_experts"], d["group_limited"]) == (
            n, k, score, shared, groups)
        assert d["expert_storage"] == "stacked" and d["dispatch"] == "grouped_mm"
        block = m.get_submodule(d["path"])
        file, line = d["source"].rsplit(":", 1)
        assert file.endswith(f"modeling_{arch}.py") and int(line) == type(block).forward.__code__.co_firstlineno


def test_hf_eager_experts_are_a_loop_over_weight_slices():
    m = hf_model("mixtral")
    m.config._experts_implementation = "eager"  # per-expert F.linear on gate_up_proj[e]
    assert {d["dispatch"] for d in find_moe(m)} == {"loop"}


def test_hand_written_loop_moe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), LoopMoE(n_experts=6, k=2))
    [d] = find_moe(model)
    assert d["path"] == "1" and d["experts"] == "experts" and d["expert_storage"] == "modulelist"
    assert (d["num_experts"], d["top_k"], d["score"], d["dispatch"], d["shared_experts"]) == (
        6, 2, "softmax", "loop", [])
    assert d["router"] == "router.weight" and d["hidden"] == 32


def test_stacked_dense_mask_moe_with_sigmoid_and_bare_router():
    torch.manual_seed(0)
    [d] = find_moe(DenseMaskMoE(n_experts=4, k=1))
    assert d["path"] == "" and d["expert_storage"] == "stacked" and d["experts"] == ""
    assert (d["num_experts"], d["top_k"], d["score"], d["dispatch"]) == (4, 1, "sigmoid", "dense")


@pytest.mark.parametrize("cls", [GatedMLP, MixtureNoTopK])
def test_not_moe(cls):
    torch.manual_seed(0)
    assert find_moe(cls()) == []


def test_probe_leaves_the_random_stream_alone():
    torch.manual_seed(1)
    m = LoopMoE()
    state = torch.get_rng_state()
    assert match("", m) is not None
    assert torch.equal(torch.get_rng_state(), state)

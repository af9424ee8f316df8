"""The bundled examples run, learn, and have the structure the profile and suggest demos rely on."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"kprof_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _losses(out: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"step\s+(\d+)\s+loss (\S+)", out)]


def test_gpt_example_trains_and_logs(capsys):
    gpt = _load("gpt_train")
    gpt.main(["--steps", "9", "--batch-size", "2", "--seq-len", "32"])
    logged = _losses(capsys.readouterr().out)
    assert [s for s, _ in logged] == [0, 4, 8]  # --log-every 4, plus the last step
    assert all(math.isfinite(v) for _, v in logged)
    assert logged[0][1] == pytest.approx(math.log(512), rel=0.05)  # uniform over the 512-token vocab at init
    assert logged[-1][1] < logged[0][1]  # one fixed batch: it must be learning


def test_gpt_example_structure():
    """Module paths the README, the profile test and kprof suggest refer to."""
    gpt = _load("gpt_train")
    model = gpt.GPT(gpt.GPTConfig())
    names = dict(model.named_modules())
    for path, cls in [("transformer.h.0.attn", "CausalSelfAttention"), ("transformer.h.1.mlp", "MLP"),
                      ("transformer.h.0.ln_1", "LayerNorm"), ("transformer.h.0.mlp.gelu", "GELU"),
                      ("lm_head", "Linear")]:
        assert type(names[path]).__name__ == cls
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert names["transformer.h.0.mlp.gelu"].approximate == "tanh"


def test_gpt_attention_matches_sdpa():
    """The hand-written attention is plain causal attention (what suggest will swap for SDPA)."""
    gpt = _load("gpt_train")
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_embd=32, n_head=4, block_size=16)
    attn = gpt.CausalSelfAttention(cfg)
    x = torch.randn(2, 11, 32)
    q, k, v = attn.c_attn(x).split(32, dim=2)
    heads = lambda t: t.view(2, 11, 4, 8).transpose(1, 2)  # noqa: E731  (B, nh, T, hs)
    y = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    ref = attn.c_proj(y.transpose(1, 2).reshape(2, 11, 32))
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)  # fp32 reorderings only


def test_llama_tiny_preset_trains(capsys):
    llama = _load("llama_train")
    llama.main(["--preset", "tiny", "--steps", "3", "--log-every", "1", "--device", "cpu"])
    logged = _losses(capsys.readouterr().out)
    assert [s for s, _ in logged] == [0, 1, 2]
    assert logged[0][1] == pytest.approx(math.log(512), rel=0.05)
    assert logged[-1][1] < logged[0][1]


def test_llama_1b_preset_size():
    """The 1b preset is about a billion parameters (built on the meta device: no memory)."""
    llama = _load("llama_train")
    with torch.device("meta"):
        model = llama.build_model("1b", torch.device("meta"), torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < n < 1.05e9
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size) == (8, 2048, 8192, 32, 8, 128256)
    assert cfg._attn_implementation == "sdpa"


@pytest.mark.gpu
def test_gpt_example_on_gpu_bf16(capsys):
    gpt = _load("gpt_train")
    gpt.main(["--device", "cuda", "--dtype", "bfloat16", "--steps", "5", "--batch-size", "8", "--seq-len", "256"])
    logged = _losses(capsys.readouterr().out)
    assert [s for s, _ in logged] == [0, 4]
    assert all(math.isfinite(v) for _, v in logged) and logged[-1][1] < logged[0][1]


@pytest.mark.gpu
@pytest.mark.gpu_large
def test_llama_1b_preset_on_gpu(capsys):
    llama = _load("llama_train")
    llama.main(["--preset", "1b", "--device", "cuda", "--steps", "3", "--log-every", "1"])
    logged = _losses(capsys.readouterr().out)
    assert [s for s, _ in logged] == [0, 1, 2]
    assert logged[0][1] == pytest.approx(math.log(128256), rel=0.1)
    assert all(math.isfinite(v) for _, v in logged)

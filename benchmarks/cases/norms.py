"""Benchmark cases: RMSNorm (Llama and Gemma casting), fused residual add + RMSNorm, LayerNorm.

Shape from the issue: 16384 tokens x 4096 hidden, bf16 (128 MiB per activation tensor, past
the H200's 60 MB L2). Floors at the measured 4.27 TB/s copy bandwidth (bytes from the specs'
cost models):
- RMSNorm:   fwd 268 MB -> 63 us; fwd+bwd 671 MB -> 157 us. Targets 70 / 200 us (issue;
  Liger 0.6 measured 70 / 680, torch.compile 132 / 739).
- LayerNorm: fwd 268 MB -> 63 us; fwd+bwd 671 MB -> 157 us. Targets 70 / 200 us (issue).
- add + RMSNorm: fwd 537 MB -> 126 us; fwd+bwd 1.07 GB -> 252 us. No target in the issue.
- Gemma RMSNorm: same bytes as Llama's. No target in the issue.

Eager peers are the formulations users run today: transformers' LlamaRMSNorm and GemmaRMSNorm
forward bodies, the decoder layer's `hidden = residual + hidden` followed by the norm, and
F.layer_norm (nn.LayerNorm). eps as in the models' configs: Llama-2/3 rms_norm_eps 1e-5,
Gemma 1e-6, nn.LayerNorm's default 1e-5.
Liger (0.6.x) peers run with in_place=False: in place, Liger writes dx into the incoming dy,
which the harness reuses across repeats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.cases import Case
from kprof.kernels import layer_norm as _ln
from kprof.kernels import rms_norm as _rms

_M, _N = 16384, 4096
_PROBLEM = {"n_rows": _M, "n_cols": _N, "dtype": torch.bfloat16}


def _act(device, dtype):
    return torch.randn(_M, _N, device=device, dtype=dtype, requires_grad=True)


def _weight(device, dtype, center: float):
    return (torch.randn(_N, device=device) * 0.1 + center).to(dtype).requires_grad_()


def _llama_inputs(device, dtype):
    return {"x": _act(device, dtype), "weight": _weight(device, dtype, 1.0), "eps": 1e-5}


def _gemma_inputs(device, dtype):
    # Gemma stores the scale minus one (zeros at init); the norm multiplies by 1 + weight.
    return {"x": _act(device, dtype), "weight": _weight(device, dtype, 0.0), "eps": 1e-6, "offset": 1.0, "casting": "gemma"}


def _add_inputs(device, dtype):
    return {"x": _act(device, dtype), "residual": _act(device, dtype), "weight": _weight(device, dtype, 1.0), "eps": 1e-5}


def _ln_inputs(device, dtype):
    return {
        "x": _act(device, dtype),
        "weight": _weight(device, dtype, 1.0),
        "bias": _weight(device, dtype, 0.0),
        "eps": 1e-5,
    }


def _eager_llama_rms_norm(x, weight, eps):
    # transformers' LlamaRMSNorm.forward
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _eager_gemma_rms_norm(x, weight, eps, offset, casting):
    # transformers' GemmaRMSNorm.forward (offset is Gemma's literal 1.0)
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (offset + weight.float())
    return out.type_as(x)


def _eager_add_rms_norm(x, residual, weight, eps):
    # LlamaDecoderLayer: `hidden_states = residual + hidden_states`, then post_attention_layernorm
    s = residual + x
    return _eager_llama_rms_norm(s, weight, eps), s


def _eager_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _liger_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, weight, eps: LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def _liger_gemma_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, weight, eps, offset, casting: LigerRMSNormFunction.apply(x, weight, eps, offset, casting, False)


def _liger_add_rms_norm():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    # Liger's S = X + R, returns (Y, S): the same contract as kprof's rms_norm_add.
    return lambda x, residual, weight, eps: LigerFusedAddRMSNormFunction.apply(
        x, residual, weight, eps, 0.0, "llama", False
    )


def _liger_layer_norm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    return lambda x, weight, bias, eps: LigerLayerNormFunction.apply(x, weight, bias, eps)


CASES: list[Case] = [
    Case(
        kernel="rms_norm",
        label=f"RMSNorm (Llama) {_M}x{_N}",
        make_inputs=_llama_inputs,
        kprof=_rms.rms_norm,
        eager=_eager_llama_rms_norm,
        liger=_liger_rms_norm,
        problem=_PROBLEM,
        targets_us={"fwd": 70, "fwdbwd": 200},  # issue; floors 63 / 157 us
    ),
    Case(
        kernel="rms_norm",
        label=f"RMSNorm (Gemma) {_M}x{_N}",
        make_inputs=_gemma_inputs,
        kprof=_rms.rms_norm,
        eager=_eager_gemma_rms_norm,
        liger=_liger_gemma_rms_norm,
        problem={**_PROBLEM, "casting": "gemma"},
        targets_us={},  # no target in the issue; same bytes as Llama's
    ),
    Case(
        kernel="rms_norm_add",
        label=f"add + RMSNorm {_M}x{_N}",
        make_inputs=_add_inputs,
        kprof=_rms.rms_norm_add,
        eager=_eager_add_rms_norm,
        liger=_liger_add_rms_norm,
        problem=_PROBLEM,
        targets_us={},  # no target in the issue; floors 126 / 252 us
    ),
    Case(
        kernel="layer_norm",
        label=f"LayerNorm {_M}x{_N}",
        make_inputs=_ln_inputs,
        kprof=_ln.layer_norm,
        eager=_eager_layer_norm,
        liger=_liger_layer_norm,
        problem=_PROBLEM,
        targets_us={"fwd": 70, "fwdbwd": 200},  # issue; floors 63 / 157 us
    ),
]

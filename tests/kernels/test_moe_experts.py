"""MoE experts (kprof.kernels.moe_experts): torch._grouped_mm + packed SwiGLU against the loop
over experts, forward and the grads of x, w_gate_up and w_down, fp32 and bf16, with empty experts
and all rows on one expert; the backend choice where _grouped_mm refuses the strides (the Triton
grouped GEMM, or the loop with one warning where Triton cannot run either).

The reference comparison (fp32 against fp64, bf16 against the loop in bf16 with the same
activation) is `moe_helpers.check_matches_reference`, shared with test_moe_grouped_gemm.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from kprof.errors import KprofError
from kprof.kernels import moe_experts as X
from kprof.kernels.common import assert_close
from moe_helpers import check_matches_reference, inputs, run

DTYPES = [torch.float32, torch.bfloat16]
# (rows per expert, hidden, intermediate): H and I multiples of 8 (_grouped_mm's 16-byte strides)
CASES = [
    ((5, 0, 7, 8, 0), 24, 40),  # two empty experts
    ((0, 0, 29, 0), 16, 8),  # all rows on one expert
    ((), 16, 8),  # no experts' rows at all: filled as zero rows over 3 experts
    pytest.param((40, 3, 0, 17, 1, 9, 0, 22), 64, 96, marks=pytest.mark.slow),
    pytest.param((512,) * 8, 1024, 2816, marks=pytest.mark.gpu),  # the Mixtral layer
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts, h, i", CASES, ids=lambda v: str(v))
def test_matches_reference(counts, h, i, dtype, device):
    x, _, wgu, wd, _ = inputs(counts, h, i, dtype, device)
    assert X.grouped_mm_backend(x, wgu, wd) == "grouped_mm"
    # weight grads are sums over each expert's rows (512 at the Mixtral shape): see assert_close_sum
    check_matches_reference(X.moe_experts, counts, h, i, dtype, device, ref_in_fp64=False)


def test_misaligned_runs_the_triton_grouped_gemm(device):
    """Strides _grouped_mm refuses (13 fp32 columns = 52 B rows) go to the Triton grouped GEMM
    (the interpreter here, the compiled kernel on a GPU), without a warning."""
    x, _, wgu, wd, _ = inputs((3, 4), 13, 8, torch.float32, device)
    assert X.grouped_mm_backend(x, wgu, wd) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_matches_reference(X.moe_experts, (3, 4), 13, 8, torch.float32, device)


def test_loop_fallback_warns_once_in_one_line(monkeypatch, device):
    """Where neither _grouped_mm (misaligned) nor Triton (a CPU tensor without the interpreter,
    simulated) runs: the per-expert loop, with a one-line warning, once."""
    monkeypatch.setattr(X, "use_triton", lambda t: False)
    monkeypatch.setattr(X, "_warned", set())
    x, offs, wgu, wd, dy = inputs((3, 4), 13, 8, torch.float32, device)
    assert X.grouped_mm_backend(x, wgu, wd) == "reference"
    with pytest.warns(UserWarning, match="per-expert loop") as w:
        y, _ = run(X.moe_experts, x, offs, wgu, wd, dy)
        run(X.moe_experts, x, offs, wgu, wd, dy)
    assert len(w) == 1 and len(str(w[0].message).splitlines()) == 1
    assert_close(y, X.moe_experts_reference(x, offs, wgu, wd))


def test_shape_errors():
    x, offs, wgu, wd, _ = inputs((3, 4), 16, 8, torch.float32, "cpu")
    with pytest.raises(KprofError, match="disagree"):
        X.moe_experts(x, offs, wgu, wd[:, :, :8])

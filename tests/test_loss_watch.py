"""apply's whole-run loss watch (kprof.patching.apply.loss_watch) on loss series measured on the
H200: the 1B Llama example, its plan run, a second unpatched run (the control) and a run with a
planted RMSNorm that drifts by 1e-3 per call (benchmarks/planted/drift_rms_norm.py)."""

from __future__ import annotations

import pytest

from kprof.patching.apply import K_DIVERGENCE, loss_floor, loss_watch

# Steps 0-4 of examples/llama_train.py --preset 1b on the H200 (fp32 losses): the plan run and
# the run with the drifting RMSNorm kept (its apply reported an unpatched spread of 0.00119; the
# control run's own series is not stored, so CONTROL carries that spread at step 4).
BEFORE = [12.167604, 9.499818, 7.332033, 5.078151, 3.035097]
DRIFT = [12.167342, 9.472493, 7.265207, 4.980934, 2.928088]
CONTROL = BEFORE[:4] + [BEFORE[4] - 0.00119]


def test_planted_drift_diverges():
    w = loss_watch(BEFORE, CONTROL, DRIFT, "torch.float32")
    assert w["diverged"] is True and w["k"] == K_DIVERGENCE and w["step"] == 1  # 0.027 off at step 1
    # Even with the whole measured spread from the first step on, it diverges at step 1.
    w = loss_watch(BEFORE, [b - 0.00119 for b in BEFORE], DRIFT, "torch.float32")
    assert w["diverged"] is True and w["step"] == 1 and w["limit"] == pytest.approx(K_DIVERGENCE * 0.00119)


def test_a_run_within_the_spread_passes():
    close = [b + 0.0003 for b in BEFORE]
    w = loss_watch(BEFORE, CONTROL, close, "torch.float32")
    assert w["diverged"] is False and w["steps"] == 5 and w["max_delta"] == pytest.approx(0.0003)


def test_bf16_losses_are_compared_at_their_spacing():
    # A loss returned in bf16 is only known to its spacing (0.0625 between 8 and 16): the same
    # values rounded to bf16 do not diverge, though they differ by more than 10x the spread.
    rounded = [12.1875, 9.5, 7.34375, 5.0625, 3.03125]
    assert loss_watch(BEFORE, BEFORE, rounded, "torch.bfloat16")["diverged"] is False
    assert loss_watch(BEFORE, BEFORE, rounded, "torch.float32")["diverged"] is True


def test_floor_where_unpatched_runs_agree_bit_for_bit():
    assert loss_floor(2.0) == pytest.approx(1e-5 + 4e-5)
    assert loss_floor(2.0, "torch.bfloat16") == pytest.approx(1e-5 + 4e-5 + 2 * 2**-7)
    w = loss_watch([1.0, 1.0], [1.0, 1.0], [1.0, 1.0 + 5e-3], "torch.float32")
    assert w["diverged"] is True and w["step"] == 1

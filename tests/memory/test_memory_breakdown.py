"""The memory breakdown (kprof/analyze/memory.py) on a synthetic allocator snapshot and the
same step as profiler events, with planted parameters, gradients, optimizer state, activations
and temporaries (tests/memory/fixtures.py)."""

import pandas as pd
import pytest

from kprof.analyze import memory
from tests.memory import fixtures as fx


def _snapshot_breakdown(**kw):
    events, live = memory.events_from_snapshot(fx.snapshot())
    fwd = pd.DataFrame(fx.FORWARD_OPS, columns=["t_us", "seq", "tid"])
    return memory.breakdown(events, memory.ranges_frame({"ranges": fx.ranges()}), fx.tensors(**kw), fwd, live)


def test_snapshot_replay_recovers_allocated_before_the_window():
    events, live = memory.events_from_snapshot(fx.snapshot())
    # 16 KiB of parameters and optimizer state were live before the first event.
    assert int(events["total_allocated"].iloc[0] - events["bytes"].iloc[0]) == 16384
    assert int(events["total_allocated"].max()) == fx.PEAK
    assert set(live["addr"]) == {fx.P1, fx.P2, fx.S1, fx.G1, fx.G2}


def test_snapshot_breakdown_matches_the_planted_peak():
    b = _snapshot_breakdown()
    assert b["peak_bytes"] == fx.PEAK
    assert b["categories"] == fx.PLANTED_PEAK
    assert b["categories_sum"] == b["peak_bytes"]
    assert b["peak_moment"] == "backward of layers.1"
    assert b["fragmentation_bytes"] == fx.RESERVED - fx.PEAK


def test_activations_saved_per_module():
    b = _snapshot_breakdown()
    saved = {r["module"]: r["bytes"] for r in b["activations_saved"]}
    assert saved == {"layers.1": 32768, "layers.0": 16384, memory.OUTSIDE: 1024}
    assert [r["module"] for r in b["activations_saved"]][0] == "layers.1"  # largest first
    assert b["activations_saved_bytes"] == 32768 + 16384 + 1024


def test_profiler_record_gives_the_same_breakdown():
    b = memory.from_record(fx.profiler_record())
    s = _snapshot_breakdown()
    assert b["categories"] == s["categories"]
    assert b["peak_moment"] == s["peak_moment"]
    assert b["max_allocated"] == b["categories_sum"]


def test_grads_kept_alive_are_gradients_before_the_step():
    rec = fx.profiler_record(pre_window=16384 + 8192)  # the grads were live at the forward's start
    # Kept grads are not allocated again in the backward: drop their allocs from the events.
    rec["events"] = [e for e in rec["events"] if e[1] not in (fx.G1, fx.G2)]
    total = 16384 + 8192
    for e in rec["events"]:
        total += e[2]
        e[3] = total
    rec["tensors"] = fx.tensors(grads_at_start=True)
    b = memory.from_record(rec)
    assert b["categories"]["gradients"] == 8192
    assert b["categories"]["other (before the step)"] == 0
    assert b["categories_sum"] == b["peak_bytes"]
    assert b["tensors"]["gradients_at_forward_start"]["bytes"] == 8192


@pytest.mark.parametrize("t, words", [(1100, "forward: layers.0"), (1450, "forward end (loss)"),
                                      (1650, "backward of layers.0"), (1850, "optimizer step")])
def test_moment_names_the_phase(t, words):
    r = memory.ranges_frame({"ranges": fx.ranges()})
    fwd = pd.DataFrame(fx.FORWARD_OPS, columns=["t_us", "seq", "tid"])
    assert memory.moment(t, r, fwd)[1] == words


def test_timeline_keeps_the_peak_when_downsampled():
    events, _ = memory.events_from_snapshot(fx.snapshot())
    tl = memory.timeline(events, start=1000, points=4)
    assert len(tl) == 4
    assert int(tl["allocated"].max()) == fx.PEAK


def test_layer_of():
    assert memory.layer_of("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert memory.layer_of("lm_head") == "lm_head"

"""MoE diagnoses (kprof.rules.diagnoses.moe, issue 21): the planted hand-written MoE and tiny HF
MoE models profiled on the CPU, a synthetic GPU table for the padding advice, and the routing
histograms the shapes step records (kprof/capture/syncs.py)."""

from __future__ import annotations

import pytest
import torch
from planted import SCRIPTS
from planted import planted_line as _line
from test_diag_shapes import _gpu_summary, _Rows

from kprof.capture.syncs import SyncDetector
from kprof.rules.diagnoses import diagnose, matmul_shapes
from kprof.rules.diagnoses.moe import blocks

MOE = ("moe_block", "moe_routing_sync", "moe_imbalance", "moe_expert_loop")


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    from kprof.analyze.profile import profile_script

    return profile_script(str(SCRIPTS / "moe_loop.py"), ["--iters", "7"], warmup=1, steps=2,
                          out_root=tmp_path_factory.mktemp("runs"))


def _by_id(run) -> dict:
    d = diagnose(run)
    return {r["id"]: r for _, r in d.iterrows()}


def test_loop_moe_block_named_with_routing_facts(loop_run):
    rows = _by_id(loop_run)
    assert set(MOE) <= set(rows)
    b = rows["moe_block"]
    assert b["where"] == "moe.* x 2" and not b["applyable"]
    assert b["how"].startswith("kprof apply --patch moe_fused") and "_grouped_mm" in b["how"]
    # the apply-able row `kprof apply --patch moe_fused` finds in the plan
    f = rows["moe_fused"]
    assert f["applyable"] and f["how"].startswith("kprof apply --patch moe_fused") and f["paths"] == b["paths"]
    from kprof.patching.install import check_rules
    from kprof.plan.suggest import parse_ids

    assert parse_ids("moe_fused", {"run": "r", "suggestions": [], "diagnoses": [dict(f)]}) == ["moe_fused"]
    check_rules(["moe_fused"], None)  # a rule id kprof.patch knows
    assert b["source"] == f"{SCRIPTS / 'moe_loop.py'}:{_line('moe_loop.py', 'topk')}"
    for d in b["details"]:
        assert (d["num_experts"], d["top_k"], d["score"], d["dispatch"], d["shared_experts"]) == (
            8, 2, "softmax", "loop", [])
        assert d["router"] == d["path"] and d["experts"] == d["path"] + ".experts"
        assert sum(d["counts"]) == 64 * 2  # every token of the batch picked 2 experts


def test_loop_moe_routing_syncs_at_their_lines(loop_run):
    s = _by_id(loop_run)["moe_routing_sync"]
    lines = {d["line"]: d["kind"] for d in s["details"]}
    assert lines == {_line("moe_loop.py", "where-sync"): "torch.where(cond) (data-dependent shape)",
                     _line("moe_loop.py", "mask-sync"): "Tensor.__getitem__[bool mask] (data-dependent shape)"}
    # one per expert per block per step: 8 experts x 2 blocks
    assert all(d["per step"] == 16 for d in s["details"])


def test_loop_moe_imbalance_and_launch_bound_loop(loop_run):
    rows = _by_id(loop_run)
    imb = rows["moe_imbalance"]
    for d in imb["details"]:
        # the router's bias sends every token to expert 0: 64 of 128 picks, mean 16
        assert d["busiest"] == 0 and d["tokens per expert"][0] == 64 and d["max/mean"] == pytest.approx(4.0)
        assert d["wasted ms/step"] == pytest.approx(d["expert GEMM ms/step"] * 0.75)
    loop = rows["moe_expert_loop"]
    for d in loop["details"]:
        # 8 experts x 3 Linears forward, x 2 (dX, dW) backward, every expert hit
        assert d["expert matmuls/step"] == 8 * 3 * 3
    assert "per-expert matmuls/step" in loop["evidence"]


@pytest.mark.slow
@pytest.mark.parametrize("arch,n,shared", [("mixtral", 4, []), ("qwen2_moe", 8, ["shared_expert", "shared_expert_gate"])])
def test_hf_moe_named_by_suggest(tmp_path, arch, n, shared):
    from kprof.analyze.profile import profile_script

    run = profile_script(str(SCRIPTS / "moe_hf.py"), ["--iters", "7", "--arch", arch], warmup=1, steps=2,
                         out_root=tmp_path)
    bs = blocks(run.ops, run.summary)
    assert [b["path"] for b in bs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for b in bs:
        assert (b["num_experts"], b["top_k"], b["score"], b["dispatch"]) == (n, 2, "softmax", "grouped_mm")
        assert [s.rsplit(".", 1)[-1] for s in b["shared_experts"]] == shared
        assert b["router"] == b["path"] + ".gate" and b["source"].rsplit(":", 1)[0].endswith(f"modeling_{arch}.py")
    # Every op with device time is costed by its own formula but aten::index, whose index list the
    # profiler does not record (no shapes, so no formula), and the script's own RNG. Not a time
    # share: on a loaded 2-core CPU aten::index's self time alone took coverage to 80.5%.
    ops = run.ops
    uncosted = ops[~ops["cost_known"].fillna(False).astype(bool) & (ops["device_time (us)"] > 0)]
    assert set(uncosted["op"]) <= {"aten::index", "aten::randint", "aten::random_"}, set(uncosted["op"])


def _expert_table(routing: bool):
    """One MoE layer on a GPU: router [T, 4096] x [4096, 8], then expert 0 of 8 with 99 routed
    tokens in a loop (misaligned M), each matmul 20 ms of a 100 ms step."""
    r = _Rows()
    for step in (0, 1):
        r.add("moe", "aten::mm", [[8192, 4096], [4096, 8]], 50.0, step=step, cls="MoE", flops=2.0 * 8192 * 4096 * 8)
        for e in range(4):
            mod = f"moe.experts.{e}"
            r.add(mod, "aten::linear", [[99, 4096], [14336, 4096]], 0.0, step=step, cls="Linear")
            r.add(mod, "aten::mm", [[99, 4096], [4096, 14336]], 5000.0, step=step, cls="Linear",
                  flops=2.0 * 99 * 4096 * 14336)
    summary = _gpu_summary(profiled_step_time_ms={"median": 100.0})
    if routing:
        summary["routing"] = [{"module": "moe", "k": 2, "choices": 8, "calls": 1, "source": "m.py:3",
                               "counts": [99] * 8}]
    return r.frame(), summary


def test_no_padding_advice_on_tokens_per_expert():
    ops, summary = _expert_table(routing=False)
    # Without the routing record the 99 looks like any odd dim: advised (the check is live).
    assert [f.details[0]["dim"] for f in matmul_shapes.find(ops, summary)] == [99]
    ops, summary = _expert_table(routing=True)
    assert [b["path"] for b in blocks(ops, summary)] == ["moe"]
    assert matmul_shapes.find(ops, summary) == []


def test_routing_histogram_counts_topk_choices():
    d = SyncDetector(__file__, cuda_run=False)
    d.install()
    try:
        d.step, d.routing, d.where = 0, True, lambda: "blk"
        x = torch.tensor([[0.1, 0.9, 0.5, 0.0], [0.8, 0.7, 0.1, 0.2], [0.3, 0.2, 0.9, 0.4]])
        torch.topk(x, 2, dim=-1)  # picks {1,2}, {0,1}, {2,3}
        x.t().topk(1, dim=0)  # over 4 choices along dim 0: 1, 0, 2
        x.topk(3, dim=0)  # 3 of 3 rows: not a choice of k < n, ignored
    finally:
        d.uninstall()
    recs = {(r["k"], r["choices"]): r for r in d.routing_summary()}
    assert set(recs) == {(2, 4), (1, 4)}
    assert recs[(2, 4)]["counts"] == [1, 2, 2, 1] and recs[(2, 4)]["module"] == "blk"
    assert recs[(1, 4)]["counts"] == [1, 1, 1, 0]
    assert recs[(2, 4)]["source"] == f"{__file__}:{test_routing_histogram_counts_topk_choices.__code__.co_firstlineno + 6}"


@pytest.mark.gpu
def test_gpu_loop_moe_syncs_are_real_and_the_loop_is_flagged(tmp_path):
    from kprof.analyze.profile import profile_script

    run = profile_script(str(SCRIPTS / "moe_loop.py"), ["--iters", "9", "--device", "cuda"], warmup=1, steps=2,
                         out_root=tmp_path)
    rows = _by_id(run)
    assert set(MOE) <= set(rows)
    assert all(s["real"] for s in run.summary["syncs"])
    assert rows["moe_expert_loop"]["saving ms/step"] > 0

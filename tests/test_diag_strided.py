"""The strided_elementwise diagnosis (kprof.rules.diagnoses.strided_elementwise) on the op table
of the hand-written Kineto-format GPU trace (tests/profile/gpu_kernel_trace.py), analysed by the
real pipeline, and on the planted GPU script (run on the H200)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kprof.analyze import ceilings, costmodel, efficiency, kernels, tables, trace
from kprof.rules.diagnoses import DIAGNOSES, diagnose, strided_elementwise

sys.path.insert(0, str(Path(__file__).parent / "profile"))
import gpu_kernel_trace
from planted import SCRIPTS


def _ops(tmp_path):
    ev = trace.load_trace(gpu_kernel_trace.write(tmp_path / "t.json.gz"))
    c = ceilings.datasheet_for("NVIDIA H200")
    ops = tables.roofline(costmodel.annotate(trace.op_table(ev)), c)
    k = kernels.kernel_table(ev, ops, c, gpu_kernel_trace.SMS)
    return efficiency.qualify(ops, gpu=True, sm_count=gpu_kernel_trace.SMS,
                              extra_causes=ops["row_id"].map(kernels.op_grid_causes(k)))


def _summary(step_ms=1.0, kind="cuda"):
    return {"device": {"type": kind, "capability": "9.0"}, "steps_recorded": 1,
            "profiled_step_time_ms": {"median": step_ms}}


def test_strided_add_found_with_an_upper_bound_saving(tmp_path):
    ops = _ops(tmp_path)
    (f,) = strided_elementwise.find(ops, _summary())
    add = ops.set_index("op").loc["aten::add"]
    assert f.where == "add in rope"
    assert f.ms_per_step == pytest.approx(0.150)
    assert f.saving_ms == pytest.approx((150.0 - add["attainable (us)"]) / 1e3)
    assert 0 < f.saving_ms < f.ms_per_step
    assert "28% of roofline" in f.evidence and "strided" in f.evidence
    assert f.cls == "memory-bound, under-used" and ".contiguous()" in f.how
    # the unaligned mul is under-used too, but not strided: not this diagnosis
    assert "mul" not in f.where
    assert strided_elementwise.DIAGNOSIS in DIAGNOSES


def test_no_finding_on_cpu_small_or_contiguous(tmp_path):
    ops = _ops(tmp_path)
    assert strided_elementwise.find(ops, _summary(kind="cpu")) == []
    assert strided_elementwise.find(ops, _summary(step_ms=100.0)) == []  # 0.15 ms of 100: under 1%
    clean = ops.assign(causes=ops["causes"].str.replace("strided", ""))
    assert strided_elementwise.find(clean, _summary()) == []
    # a run saved before the qualifier existed has no such columns
    assert strided_elementwise.find(ops.drop(columns=[efficiency.QUALIFIER, "causes"]), _summary()) == []


@pytest.mark.gpu
def test_gpu_strided_rotate_half_flagged_and_contiguous_not(tmp_path):
    from kprof.analyze.profile import profile_script

    script = str(SCRIPTS / "strided_elementwise.py")
    run = profile_script(script, ["--iters", "11"], warmup=2, steps=3, out_root=tmp_path)
    d = diagnose(run).set_index("id")
    assert "strided_elementwise" in d.index, diagnose(run)
    assert 0 < d.loc["strided_elementwise", "saving ms/step"] < d.loc["strided_elementwise", "ms/step"], d
    ops = run.ops
    cols = [c for c in ("op", "class", "% of roofline", efficiency.QUALIFIER, "causes", "device_time (us)") if c in ops]
    assert ops.loc[ops[efficiency.QUALIFIER], "causes"].str.contains("strided").any(), ops[cols].to_string()
    # Contiguous halves: only the two .contiguous() copies still read a strided view, so less
    # strided time, if any is left under-used.
    clean = diagnose(profile_script(script, ["--contiguous", "--iters", "11"], warmup=2, steps=3,
                                    out_root=tmp_path)).set_index("id")
    left = clean.loc["strided_elementwise", "ms/step"].sum() if "strided_elementwise" in clean.index else 0.0
    assert left < d.loc["strided_elementwise", "ms/step"].sum(), (clean, d)

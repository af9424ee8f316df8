"""Faults around `kprof apply` and its `--write`: bad targets are refused before any run starts,
a failing or interrupted script gives its exit code, and a failed apply's partial run is marked
so that later commands do not plan from it (tests/faults/faultkit.py)."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from faultkit import ReadOnly, check, digest, flat, kprof, runs_intact
from kprof import store

# Raises at step FAIL_AT of the run number FAIL_RUN in this test (counted in a file beside it):
# apply runs the script twice, the ablation then the after run.
SCRIPT = textwrap.dedent("""\
    import sys
    from pathlib import Path
    import torch
    fail_run, fail_at, how = (sys.argv[1:4] + ["0", "-1", "raise"])[:3] if len(sys.argv) > 1 else ("0", "-1", "raise")
    counter = Path(__file__).with_name("runs.count")
    run = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(run))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(60):
        loss = model(torch.randn(8, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if run == int(fail_run) and i == int(fail_at):
            if how == "interrupt":
                raise KeyboardInterrupt
            raise ValueError(f"planted failure in run {run} at step {i}")
    """)

# A user rule that matches LayerNorm like the built-in one but whose replacement is wrong.
BAD_RULE = textwrap.dedent("""\
    import dataclasses
    from kprof.rules.layer_norm import RULE as LN

    def replace(m, p):
        def forward(x):
            return x * 2.0  # wrong: no normalisation at all
        return {"": forward}

    RULE = dataclasses.replace(LN, id="bad_layer_norm", replace=replace)
    """)


# Right except at one input shape: a batch of 5 rows (the script's every 4th step).
SHAPE_BUG_RULE = textwrap.dedent("""\
    import dataclasses
    import torch.nn.functional as F
    from kprof.rules.layer_norm import RULE as LN

    def replace(m, p):
        def forward(x):
            y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
            return y * 1.5 if x.shape[0] == 5 else y
        return {"": forward}

    RULE = dataclasses.replace(LN, id="shape_bug", replace=replace)
    """)


# Right at its first two calls (the first-call verification passes), wrong from the third on.
LATE_BUG_RULE = textwrap.dedent("""\
    import dataclasses
    import torch.nn.functional as F
    from kprof.rules.layer_norm import RULE as LN

    def replace(m, p):
        calls = [0]

        def forward(x):
            calls[0] += 1
            y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
            return y if calls[0] < 3 else y * 1.5
        return {"": forward}

    RULE = dataclasses.replace(LN, id="late_bug", replace=replace)
    """)


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A profiled run of SCRIPT (no plan.json yet), copied afresh by each test."""
    base = tmp_path_factory.mktemp("planned")
    (base / "train.py").write_text(SCRIPT)
    res = kprof("profile", base / "train.py", "--warmup", "1", "--steps", "2", "--out", base / "runs")
    assert res.code == 0, res.err
    return base


@pytest.fixture
def work(planned, tmp_path, monkeypatch) -> Path:
    shutil.copytree(planned / "runs", tmp_path / "runs")
    (tmp_path / "train.py").write_text(SCRIPT)
    for run in store.list_runs(tmp_path / "runs"):  # the copy is a run of this folder's script
        s = json.loads((run / store.SUMMARY).read_text())
        (run / store.SUMMARY).write_text(json.dumps(s | {"script": str(tmp_path / "train.py")}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _apply(work: Path, *args):
    return kprof("apply", work / "train.py", "--out", work / "runs", *args)


def _unchanged(work: Path, before: dict, n_runs: int) -> None:
    assert digest(work / "train.py", work / "runs") == before or len(runs_intact(work / "runs")) > n_runs
    assert (work / "train.py").read_text() == SCRIPT


@pytest.mark.parametrize("name", ["write_existing", "write_the_script", "write_folder", "write_missing_folder"])
def test_write_target_refused_before_the_run(work, name):
    target = {"write_existing": work / "keep.py", "write_the_script": work / "train.py",
              "write_folder": work / "sub", "write_missing_folder": work / "nowhere" / "keep.py"}[name]
    if name == "write_existing":
        target.write_text("# the user's own file\n")
    if name == "write_folder":
        target.mkdir()
    before = digest(work)
    res = _apply(work, "--write", target)
    check(res, name)
    assert digest(work) == before  # no run started: no new run, every file as it was
    assert (work / "runs.count").exists() is False


def test_write_read_only(work):
    ro = work / "ro"
    ro.mkdir()
    with ReadOnly(ro):
        res = _apply(work, "--write", ro / "keep.py")
    check(res, "write_read_only")
    assert not (work / "runs.count").exists() and list(ro.iterdir()) == []


def test_write_force_keeps_bak(work):
    keep = work / "keep.py"
    keep.write_text("# mine\n")
    (work / "keep.py.bak").write_text("# an older backup\n")
    res = _apply(work, "--steps", "14", "--keep-losers", "--write", keep, "--force")
    check(res, "write_force_keeps_bak")
    assert (work / "keep.py.bak").read_text() == "# an older backup\n"  # never overwritten
    assert (work / "keep.py.bak.1").read_text() == "# mine\n"
    assert "kprof.patch(model" in keep.read_text()


def test_unknown_patch_id(work):
    before = digest(work)
    res = _apply(work, "--patch", "nope")
    check(res, "unknown_patch_id")
    assert "layer_norm" in res.err  # names the ids there are
    assert not (work / "runs.count").exists()
    # the plan and its diffs (written by the planning, before the id is checked) are all that is new
    planned = {str(p) for p in (work / "runs").rglob("plan.json")} | {
        str(p) for p in (work / "runs").rglob("diffs/*.patch")}
    assert set(digest(work)) - set(before) <= planned


@pytest.mark.parametrize("name, text", [("rules_file_broken", "def broken(:\n"),
                                        ("rules_file_without_rule", "X = 1\n")])
def test_rules_file_faults(work, name, text):
    rules = work / "rules"
    rules.mkdir()
    (rules / "mine.py").write_text(text)
    before = digest(work)
    for res in (kprof("suggest", "--rules", rules, "--out", work / "runs"), _apply(work, "--rules", rules)):
        check(res, name)
        assert "mine.py" in flat(res.err)
    assert digest(work) == before


def test_apply_raises_in_ablation(work):
    n = len(store.list_runs(work / "runs"))
    res = _apply(work, "--steps", "14", "--", "1", "5")
    check(res, "apply_raises_in_ablation")
    assert "planted failure in run 1" in res.err  # the script's error, shown
    assert len(runs_intact(work / "runs")) == n


def test_apply_raises_in_after_run(work):
    res = _apply(work, "--steps", "14", "--keep-losers", "--write", work / "keep.py", "--", "2", "5")
    check(res, "apply_raises_in_after_run")
    assert not (work / "keep.py").exists()  # a failed apply writes nothing
    runs = runs_intact(work / "runs")
    partial = store.load_summary(runs[-1])
    assert partial["status"] == "error" and partial["apply_of"]["run"] == runs[0].name
    assert not store.is_plain_run(runs[-1])
    # later commands plan from the plain run, not from the failed apply's patched one
    assert store.latest_plain_run(work / "runs").name == runs[0].name
    sug = kprof("suggest", "--out", work / "runs")
    assert sug.code == 0 and runs[0].name in sug.out.replace("\n", "")
    listed = kprof("runs", "--out", work / "runs")
    assert listed.code == 0 and "error (apply)" in listed.out  # marked in the listing too


def test_apply_ctrl_c(work):
    n = len(store.list_runs(work / "runs"))
    res = _apply(work, "--steps", "14", "--", "1", "5", "interrupt")
    check(res, "apply_ctrl_c")
    assert len(runs_intact(work / "runs")) == n


def test_apply_ctrl_c_in_after_run(work):
    res = _apply(work, "--steps", "14", "--keep-losers", "--", "2", "5", "interrupt")
    check(res, "apply_ctrl_c_in_after_run")
    runs = runs_intact(work / "runs")
    partial = store.load_summary(runs[-1])
    assert partial["status"] == "interrupted" and partial["apply_of"]["run"] == runs[0].name
    assert store.latest_plain_run(work / "runs").name == runs[0].name


def test_strict_wrong_kernel(work):
    rules = work / "rules"
    rules.mkdir()
    (rules / "bad.py").write_text(BAD_RULE)
    res = _apply(work, "--rules", rules, "--patch", "bad_layer_norm", "--strict", "--steps", "14")
    check(res, "strict_wrong_kernel")
    assert "bad_layer_norm" in res.err and "failed verification" in res.err
    # without --strict the wrong patch is reverted and the run goes on
    res = _apply(work, "--rules", rules, "--patch", "bad_layer_norm", "--steps", "14")
    assert res.code == 0 and "failed verification" in " ".join(res.out.split())


def test_kernel_wrong_for_one_shape(work):
    # The first calls (batch 8) verify; the batch of 5 at every 4th step is verified again as a
    # new shape and fails: reverted and reported, and fatal under --strict.
    (work / "train.py").write_text(SCRIPT.replace("torch.randn(8, 8)", "torch.randn(5 if i % 4 == 3 else 8, 8)"))
    rules = work / "rules"
    rules.mkdir()
    (rules / "bug.py").write_text(SHAPE_BUG_RULE)
    res = _apply(work, "--rules", rules, "--patch", "shape_bug", "--strict", "--steps", "14")
    check(res, "kernel_wrong_for_one_shape")
    assert "[5, 16]" in res.err  # the shape it failed at
    res = _apply(work, "--rules", rules, "--patch", "shape_bug", "--steps", "14", "--json")
    assert res.code == 0
    doc = json.loads(res.out)
    (rec,) = doc["records"]["ablation"]
    assert rec["status"] == "reverted" and doc["kept"] == []


def test_kernel_wrong_from_its_third_call(work):
    # Verified at its first call, kept (--keep-losers), then wrong: the loss watch compares every
    # step's loss with the unpatched run's and calls it diverged; nothing is written.
    rules = work / "rules"
    rules.mkdir()
    (rules / "bug.py").write_text(LATE_BUG_RULE)
    res = _apply(work, "--rules", rules, "--patch", "late_bug", "--keep-losers", "--steps", "14",
                 "--write", work / "keep.py")
    check(res, "kernel_wrong_from_third_call")
    assert "loss diverged at step" in " ".join(res.out.split()) and not (work / "keep.py").exists()
    after = store.load_run(None, work / "runs")
    doc = json.loads((after.path / store.APPLY).read_text())
    assert doc["loss_watch"]["diverged"] is True and doc["loss_watch"]["k"] == 10


def test_loss_watch_passes_a_correct_patch(work):
    # The built-in layer_norm, kept: every step's loss within 10x the unpatched runs' spread
    res = _apply(work, "--patch", "layer_norm", "--keep-losers", "--steps", "14", "--json")
    assert res.code == 0, res.err
    w = json.loads(res.out)["loss_watch"]
    assert w["diverged"] is False and w["steps"] >= 6

"""Every suggestion apply can't install carries its exact change: the diffs kprof suggest saves
(kprof.rules.edits) are applied with GNU `patch` to copies of the planted scripts, which then run
(CPU, small); a hand-written attention replaced by SDPA keeps the first loss. Where no exact
change can be derived, the record says why and has no diff."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from planted import SCRIPTS

from kprof.analyze.profile import profile_script
from kprof.plan.suggest import save_plan, suggest
from kprof.rules import edits
from kprof.rules.diagnoses import diagnose

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="needs GNU patch")


@pytest.fixture
def planted(tmp_path):
    """A copy of the planted scripts (patched in place by the tests)."""
    dst = tmp_path / "scripts"
    shutil.copytree(SCRIPTS, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _plan(script: Path, args: list[str], root: Path) -> dict:
    run = profile_script(str(script), args, warmup=1, steps=2, out_root=root)
    save_plan(run, suggest(run), diagnose(run))
    return json.loads((Path(run.path) / "plan.json").read_text())


def _entry(plan: dict, rid: str) -> dict:
    (e,) = [e for e in plan["suggestions"] + plan["diagnoses"] if e["id"] == rid]
    return e


def _patch(d: dict, cwd: Path) -> None:
    """Apply a diff record the way the plan tells the user to (its `command`)."""
    assert d["unified_diff"] and d["reason"] is None, d
    assert Path(d["patch_file"]).read_text() == d["unified_diff"]
    res = subprocess.run(d["command"], shell=True, cwd=cwd, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAILED" not in res.stdout and "offset" not in res.stdout, res.stdout  # applies exactly


def _run(script: Path, args: list[str]) -> dict:
    """Run a (patched) planted script in-process; its globals after the loop."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        return runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.modules.pop("tiny", None)  # the copy's helper module, not the next test's


def test_manual_attention_diff_is_sdpa_with_the_same_loss(planted, tmp_path, monkeypatch):
    monkeypatch.chdir(planted)  # the script under the working directory: a `patch -p0` diff
    plan = _plan(Path("manual_attention.py"), ["--iters", "8"], tmp_path / "runs")
    d = _entry(plan, "manual_attention")["diff"]
    assert d["file"] == "manual_attention.py" and d["command"].startswith("patch -p0 <")
    before = _run(planted / "manual_attention.py", ["--iters", "1"])["loss"].item()
    _patch(d, planted)
    text = (planted / "manual_attention.py").read_text()
    assert "F.scaled_dot_product_attention(q, k, v, is_causal=True" in text and "F.softmax" not in text
    # the diff starts at the scores line, the chain the softmax line belongs to
    assert d["line"] == next(i for i, ln in enumerate(text.splitlines(), 1) if "scaled_dot_product" in ln)
    after = _run(planted / "manual_attention.py", ["--iters", "1"])["loss"].item()
    assert after == pytest.approx(before, rel=1e-5)  # same weights and batch: SDPA computes the same


CASES = [
    # script, args, diagnosis id, what the patched file holds, what it no longer holds
    ("adamw_loop.py", ["--iters", "8"], "unfused_optimizer", ["fused=True"], ["foreach=False"]),
    pytest.param("slow_loader.py", ["--iters", "8"], "input_pipeline",
                 ["pin_memory=True", "persistent_workers=True", "non_blocking=True"], ["num_workers=0)  # kprof-test"],
                 marks=pytest.mark.slow),
    pytest.param("odd_vocab.py", ["--iters", "8"], "matmul_shapes", ["default=50304"], ["default=50257)"],
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("script,args,rid,has,gone", CASES)
def test_diagnosis_diff_applies_and_the_script_runs(planted, tmp_path, script, args, rid, has, gone):
    # profiled by absolute path outside the working directory: the command patches in the file's folder
    plan = _plan(planted / script, args, tmp_path / "runs")
    d = _entry(plan, rid)["diff"]
    assert Path(d["file"]).is_absolute() and d["command"].startswith(f"patch -d {planted} <")
    _patch(d, tmp_path)
    text = (planted / script).read_text()
    assert all(h in text for h in has) and not any(g in text for g in gone), text
    out = _run(planted / script, ["--iters", "2"])
    assert out["loss"].isfinite().item()  # it ran to a real loss


def test_tf32_diff_sets_the_scripts_own_flag(planted):
    # fp32_matmul fires on tensor-core GPUs only: the builder on the planted script directly
    d = edits.tf32(str(planted / "fp32_matmul.py"))
    assert "+torch.backends.cuda.matmul.allow_tf32 = True" in d["unified_diff"]
    assert "-torch.backends.cuda.matmul.allow_tf32 = args.tf32" in d["unified_diff"]
    (planted / "x.patch").write_text(d["unified_diff"])
    res = subprocess.run(["patch", "-d", str(planted)], stdin=(planted / "x.patch").open(), capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    _run(planted / "fp32_matmul.py", ["--iters", "1"])


_ATTN = """
import math, torch
import torch.nn.functional as F
from torch import nn

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(8, 8)))
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.bias[:8, :8] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.drop(att)
        y = att @ v
        {extra}
        return y
"""


def test_sdpa_diff_or_its_reason(tmp_path):
    f = tmp_path / "attn.py"
    f.write_text(_ATTN.replace("{extra}", "pass"))
    line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if "softmax" in ln)
    d = edits.sdpa(str(f), line)
    new = [ln for ln in d["unified_diff"].splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert new == ["+        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop.p if self.training else "
                   "0.0, is_causal=True, scale=1.0 / (math.sqrt(k.size(-1))))"]
    # the weights used after `@ v`: SDPA doesn't return them, so no diff, and the reason says so
    f.write_text(_ATTN.replace("{extra}", "self.last = att"))
    d = edits.sdpa(str(f), line)
    assert d["unified_diff"] is None and "used again" in d["reason"]
    # a mask that is not the negated tril: no is_causal guess
    f.write_text(_ATTN.replace("{extra}", "pass").replace("== 0", "== 1"))
    d = edits.sdpa(str(f), line)
    assert d["unified_diff"] is None and "causal tril mask" in d["reason"]


def test_no_diff_records_say_why(tmp_path):
    f = tmp_path / "train.py"
    f.write_text(textwrap.dedent("""
        import torch
        kw = dict(lr=1e-3)
        opt = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], **kw)
    """))
    d = edits.call_keywords(str(f), 4, ("AdamW",), {"fused": "True"})
    assert d["unified_diff"] is None and "**kwargs" in d["reason"]
    d = edits.call_keywords(str(tmp_path / "missing.py"), 1, ("AdamW",), {"fused": "True"})
    assert d["unified_diff"] is None and "not readable" in d["reason"]

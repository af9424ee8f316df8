"""Faults in the user's script under `kprof profile`: it raises, exits, is interrupted, never
steps, or prints what a terminal or rich would choke on. Each keeps the user's files and the
runs, and ends with the documented exit code and one error line (tests/faults/faultkit.py)."""

from __future__ import annotations

import re

from faultkit import check, digest, flat, kprof, runs_intact, script
from kprof import store

FAST = ["--warmup", "1", "--steps", "2"]


def _profile(tmp_path, body: str, *extra, steps: int = 40):
    s = script(tmp_path, body, steps=steps)
    before = digest(s)
    res = kprof("profile", s, *FAST, "--out", tmp_path / "runs", *extra)
    assert digest(s) == before  # the user's script is never touched
    return res, runs_intact(tmp_path / "runs")


def test_raise_before_steps(tmp_path):
    res, runs = _profile(tmp_path, "if i == 0: raise ValueError('too early [/x]')\n")
    check(res, "raise_before_steps")
    assert "ValueError: too early [/x]" in res.err  # the script's own error, shown as text
    assert runs == []


def test_raise_in_recorded_steps(tmp_path):
    res, runs = _profile(tmp_path, "if i == 4: raise ValueError('planted')\n")
    check(res, "raise_in_recorded_steps")
    (run,) = runs
    s = store.load_summary(run)
    assert s["status"] == "error" and s["steps_recorded"] >= 1 and "ValueError: planted" in s["error"]
    assert flat(str(run)) in flat(res.err)


def test_raise_after_recorded_steps(tmp_path):
    res, runs = _profile(tmp_path, "if i == 9: raise ValueError('after the loop')\n", "--run-to-end", steps=10)
    check(res, "raise_after_recorded_steps")
    (run,) = runs
    s = store.load_summary(run)
    assert s["status"] == "error" and s["steps_recorded"] == 2  # every recorded step kept


def test_sys_exit_3(tmp_path):
    res, runs = _profile(tmp_path, "if i == 4: sys.exit(3)\n")
    check(res, "sys_exit_3")
    (run,) = runs
    assert store.load_summary(run)["exit_code"] == 3  # the script's own code, kept in the run


def test_ctrl_c_in_recorded_steps(tmp_path):
    res, runs = _profile(tmp_path, "if i == 4: raise KeyboardInterrupt\n")
    check(res, "ctrl_c_in_recorded_steps")
    (run,) = runs
    s = store.load_summary(run)
    assert s["status"] == "interrupted" and s["steps_recorded"] == 1


def test_ctrl_c_during_analysis(tmp_path, monkeypatch):
    def interrupted(raw):
        raise KeyboardInterrupt

    monkeypatch.setattr("kprof.analyze.profile.analyse", interrupted)
    res, runs = _profile(tmp_path, "")
    check(res, "ctrl_c_during_analysis")
    (run,) = runs
    s = store.load_summary(run)
    assert s["status"] == "interrupted" and s["steps_recorded"] == 2 and (run / store.TRACE).is_file()
    # the saved partial run is marked, and still opens
    r = kprof("report", run)
    assert r.code == 0 and "interrupted" in r.out


def test_never_steps(tmp_path):
    s = tmp_path / "idle.py"
    s.write_text("import torch\nx = torch.ones(3) * 2\nprint('no model here')\n")
    res = kprof("profile", s, "--out", tmp_path / "runs")
    check(res, "never_steps")
    assert runs_intact(tmp_path / "runs") == []


def test_no_backward_hint_names_step_forward(tmp_path):
    # An inference loop: module calls but no optimizer step, too few to decide on forward steps.
    s = tmp_path / "infer.py"
    s.write_text("import torch\nm = torch.nn.Linear(8, 8)\nwith torch.no_grad():\n"
                 "    for i in range(10):\n        m(torch.randn(4, 8))\n")
    res = kprof("profile", s, *FAST, "--out", tmp_path / "runs")
    assert res.code == 2 and flat("pass --step forward") in flat(res.err)
    res = kprof("profile", s, *FAST, "--step", "forward", "--out", tmp_path / "runs")
    assert res.code == 0 and len(runs_intact(tmp_path / "runs")) == 1  # the hint works


def test_markup_in_output(tmp_path):
    # in the script's output, and in its source line, which the host-sync table and suggest quote
    body = 'print("[/train] [bold]x\\x1b[31m red \\x07", loss.item())  # [/train] [red]\n'
    res, runs = _profile(tmp_path, body)
    check(res, "markup_in_output")
    assert "[/train] [bold]x" in res.out and len(runs) == 1
    assert flat("# [/train] [red]") in flat(res.out)
    res = kprof("suggest", "--out", tmp_path / "runs")
    check(res, "markup_in_output")
    assert flat("[/train] [red]") in flat(res.out)


def test_non_utf8_output(tmp_path):
    body = ("sys.stdout.flush(); sys.stdout.buffer.write(b'\\xff\\xfe bytes\\n'); sys.stdout.buffer.flush()\n"
            "print('caf\\u00e9'.encode('latin-1').decode('utf-8', 'surrogateescape'), file=sys.stderr)\n")
    res, runs = _profile(tmp_path, body)
    check(res, "non_utf8_output")
    assert len(runs) == 1 and "bytes" in res.out


def test_huge_output(tmp_path):
    body = "sys.stdout.write('x' * (2 << 20))\n"
    res, runs = _profile(tmp_path, body)
    assert len(runs) == 1 and res.out.count("x" * (2 << 20)) >= 6  # every step's flood went through
    # kprof's report follows the flood whole; the script's own 2 MB line is not kprof's to wrap
    res.out = re.sub(r"x{1000,}", "", res.out)
    check(res, "huge_output")
    assert "summary.json" in res.out

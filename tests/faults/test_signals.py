"""Real signals, in a real process: SIGINT and SIGTERM sent to a child `python -m kprof` at
several points, and a SIGINT that lands while the trace is written. The child's script writes a
marker file when it reaches the planted point, and only then is the signal sent (to the child's
own PID), so nothing here depends on timing (tests/faults/faultkit.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from faultkit import REPO, Result, check, child, digest, kprof_process, runs_intact, script
from kprof import store

FAST = ["--warmup", "1", "--steps", "2"]


def _wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 300) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, (path.parent / "stderr.txt").read_text()
        assert time.monotonic() - t0 < limit_s, "the child never reached the planted point"
        time.sleep(0.05)


def _result(proc: subprocess.Popen, cwd: Path) -> Result:
    code = proc.wait(300)
    return Result(code, (cwd / "stdout.txt").read_text(errors="replace"),
                  "\n".join(ln for ln in (cwd / "stderr.txt").read_text(errors="replace").splitlines()
                            if not ln.startswith("USDT:")))  # the profiler's C++ log lines


def _signalled(tmp_path: Path, at_step: int, sig: int):
    body = f"if i == {at_step}:\n    open('reached', 'w').close()\n    time.sleep(120)\n"
    s = script(tmp_path, body)
    before = digest(s)
    proc = kprof_process("profile", s, *FAST, "--out", tmp_path / "runs", cwd=tmp_path)
    _wait_for(tmp_path / "reached", proc)
    proc.send_signal(sig)
    res = _result(proc, tmp_path)
    assert digest(s) == before
    return res, runs_intact(tmp_path / "runs")


def test_sigterm_in_recorded_steps(tmp_path):
    res, runs = _signalled(tmp_path, 4, signal.SIGTERM)
    check(res, "sigterm_in_recorded_steps")
    (run,) = runs
    s = store.load_summary(run)
    assert s["status"] == "interrupted" and s["steps_recorded"] == 1


def test_sigint_in_recorded_steps(tmp_path):
    res, runs = _signalled(tmp_path, 4, signal.SIGINT)
    check(res, "sigint_in_recorded_steps")
    (run,) = runs
    assert store.load_summary(run)["status"] == "interrupted"


def test_sigint_in_warmup(tmp_path):
    res, runs = _signalled(tmp_path, 0, signal.SIGINT)
    check(res, "sigint_in_warmup")
    assert runs == []


def test_ctrl_c_while_trace_written(tmp_path):
    # The child interrupts itself from inside the trace export, the moment just after the last
    # recorded step that used to lose the whole run.
    s = script(tmp_path, "")
    runner = tmp_path / "run_kprof.py"
    runner.write_text(textwrap.dedent(f"""\
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from torch.profiler import profile
        real = profile.export_chrome_trace
        def export(self, path):
            os.kill(os.getpid(), signal.SIGINT)
            return real(self, path)
        profile.export_chrome_trace = export
        from kprof.cli import main
        main(sys.argv[1:])
        """))
    cmd = [sys.executable, str(runner), "profile", str(s), *FAST, "--out", str(tmp_path / "runs")]
    proc = child(cmd, tmp_path)
    res = _result(proc, tmp_path)
    check(res, "ctrl_c_while_trace_written")
    (run,) = runs_intact(tmp_path / "runs")
    s = store.load_summary(run)
    assert s["status"] == "interrupted" and s["steps_recorded"] == 2 and (run / store.TRACE).is_file()

"""The fault suite's planted faults and the checks every one of them gets.

FAULTS is the one list: each planted fault, what kprof says (a phrase of its one-line error or
warning) and the exit code. The tests read their expected code and phrase from it, and
tests/faults/test_docs.py checks that docs/faults.md is this table, so the two cannot drift.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kprof import store

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fault:
    fault: str  # what was planted
    says: str  # a phrase of what kprof prints (the error line, or the warning)
    code: int  # the documented exit code


FAULTS: dict[str, Fault] = {f.split("|")[0].strip(): Fault(*(x.strip() for x in f.split("|")[1:3]), int(f.split("|")[3]))
                            for f in """
raise_before_steps | the script raises before its first step | before any step was recorded, so nothing was saved | 1
raise_in_recorded_steps | the script raises in a recorded step | the partial run is kept | 1
raise_after_recorded_steps | the script raises after its loop (--run-to-end) | the partial run is kept | 1
sys_exit_3 | the script calls sys.exit(3) | failed (exit code 3) | 1
ctrl_c_in_recorded_steps | Ctrl-C (KeyboardInterrupt) in a recorded step | interrupted after 1 recorded step | 130
ctrl_c_while_trace_written | SIGINT while the trace is exported, just after the last recorded step | interrupted after 2 recorded steps | 130
ctrl_c_during_analysis | Ctrl-C while kprof analyses the trace | interrupted during kprof's analysis | 130
sigint_in_recorded_steps | SIGINT from outside, during the recorded steps (a real process) | the partial run is kept | 130
sigint_in_warmup | SIGINT from outside, during the warm-up (a real process) | interrupted before any step was recorded | 130
sigterm_in_recorded_steps | SIGTERM from outside, during the recorded steps (a real process) | the partial run is kept | 130
never_steps | the script never calls a module or an optimizer | no step was recorded | 2
markup_in_output | rich markup ([/train], [bold]) and control characters in the script's output and source | (no error: printed as text) | 0
non_utf8_output | the script writes bytes that are not UTF-8, and a lone surrogate | (no error) | 0
huge_output | the script prints 2 MB per step, one line without a newline | (no error) | 0
write_existing | apply --write onto an existing file | exists; pass a new file name, or add --force | 2
write_the_script | apply --write onto the training script itself | is the training script itself | 2
write_folder | apply --write onto a folder | is a folder | 2
write_missing_folder | apply --write into a folder that does not exist | does not exist | 2
write_read_only | apply --write into a read-only folder | cannot write in | 2
write_force_keeps_bak | apply --write --force onto a file, a FILE.bak already there | the old file is kept as | 0
store_read_only_profile | kprof profile into a read-only run store | is not writable | 2
store_read_only_suggest | kprof suggest on a read-only run store | plan.json was not saved | 0
store_read_only_apply | kprof apply on a read-only run store | is not writable | 2
store_missing | suggest, report and apply with no run store | no runs in | 2
store_is_a_file | --out names a file | cannot create the run store | 2
store_full | the disk fills while the run is saved (ENOSPC) | cannot save the run | 2
summary_corrupt | a run's summary.json is not JSON | is corrupt | 2
summary_wrong_types | a run's summary.json has fields of the wrong type | is corrupt (field | 2
trace_truncated | the profiler's trace is truncated on disk | it may be truncated | 2
two_writers | two processes save runs and plans in the same store at once | (no error: both kept) | 0
rules_file_broken | a --rules file with a syntax error | importing | 2
rules_file_without_rule | a --rules file that defines no RULE | defines neither RULE nor RULES | 2
unknown_patch_id | apply --patch with an id not in the plan | not in the plan of run | 2
apply_raises_in_ablation | the script raises during apply's ablation run | during kprof apply's ablation run | 1
apply_raises_in_after_run | the script raises during apply's after run | during kprof apply's after run | 1
apply_ctrl_c | Ctrl-C during apply's ablation run | interrupted during kprof apply's ablation run | 130
apply_ctrl_c_in_after_run | Ctrl-C during apply's after run (the kept patches, profiled) | is kept, marked interrupted and as apply's | 130
strict_wrong_kernel | a patch whose kernel is wrong, under --strict | --strict: | 3
kernel_wrong_from_third_call | a kernel right at its first calls (verified), wrong from its 3rd, kept | loss diverged from the unpatched one | 3
kernel_wrong_for_one_shape | a kernel right at the first call's shape, wrong at one other, under --strict | wrong at a new input shape | 3
""".strip().splitlines()}


def fault(name: str) -> Fault:
    return FAULTS[name]


# ------------------------------------------------------------------------------------------
# Planted scripts


def script(tmp: Path, body: str, *, name: str = "train.py", layer_norm: bool = False, steps: int = 40) -> Path:
    """A tiny seeded training script; `body` runs at the end of each step `i` (after
    optimizer.step), `head` code can read sys.argv. `layer_norm` adds an nn.LayerNorm, which
    kprof suggest plans a patch for."""
    mid = "torch.nn.LayerNorm(16), " if layer_norm else ""
    src = textwrap.dedent(f"""\
        import os, signal, sys, time
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), {mid}torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range({steps}):
            loss = model(torch.randn(8, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        """) + textwrap.indent(textwrap.dedent(body), "    ")
    p = tmp / name
    p.write_text(src)
    return p


# ------------------------------------------------------------------------------------------
# Running kprof


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def kprof(*args, env: dict | None = None) -> Result:
    """`kprof ARGS` in-process through kprof.cli.main (the real entry point), with stdout and
    stderr captured as bytes at 80 columns, like a pipe."""
    runner = CliRunner()
    with runner.isolation(env={"COLUMNS": "80", **(env or {})}) as (out, err, _):
        from kprof import cli

        try:
            cli.main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        return Result(code, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace"))


def kprof_process(*args, cwd: Path) -> subprocess.Popen:
    """`python -m kprof ARGS` as a child process (for real signals), output to files in cwd."""
    return child([sys.executable, "-m", "kprof", *map(str, args)], cwd)


def child(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """`cmd` as a child process in `cwd`, its stdout and stderr to files there."""
    env = dict(os.environ, COLUMNS="80", PYTHONUNBUFFERED="1")
    with open(cwd / "stdout.txt", "wb") as out, open(cwd / "stderr.txt", "wb") as err:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err)  # the child keeps its copies


# ------------------------------------------------------------------------------------------
# The checks


def check(res: Result, name: str) -> None:
    """The documented exit code, the documented phrase, one error line saying what to do next,
    and no traceback from kprof's own code."""
    f = FAULTS[name]
    assert res.code == f.code, f"{name}: exit {res.code}, documented {f.code}\n{res.text}"
    # kprof frames in a traceback would name files under kprof/ (the user's own traceback names
    # only the script)
    assert not re.search(r'File "[^"]*[/\\](kprof|rules|kernels)[/\\]', res.text), res.text
    joined = " ".join(res.err.split())
    if not f.says.startswith("("):
        assert flat(f.says) in flat(res.text), f"{name}: {f.says!r} not in\n{res.text}"
    if f.code != 0:
        errors = re.findall(r"(?m)^error: ", res.err)
        assert len(errors) == 1, res.err
        # one line of text: the message is a single logical line (rich only wraps it at 80 columns)
        msg = joined[joined.index("error: "):]
        assert re.search(r"; |\(|: ", msg), msg  # says what to do next, or what was kept
    for line in res.text.splitlines():
        assert len(line) <= 80, f"wider than 80 columns: {line!r}"


def flat(text: str) -> str:
    """`text` without whitespace: rich folds long paths and words at 80 columns."""
    return re.sub(r"\s+", "", text)


def digest(*paths: Path) -> dict[str, str]:
    """sha256 of every file under `paths`: the user's files and the runs, to compare after."""
    out = {}
    for p in paths:
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.exists() else []
        for q in files:
            out[str(q)] = hashlib.sha256(q.read_bytes()).hexdigest()
    return out


def runs_intact(root: Path) -> list[Path]:
    """Every run in the store loads, and no half-written (.tmp-*) folder is left behind."""
    runs = store.list_runs(root)
    for r in runs:
        store.load_summary(r)
    if root.is_dir():
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    return runs


# ------------------------------------------------------------------------------------------
# A read-only folder that holds even for root (chmod does not stop root; chattr +i does)


class ReadOnly:
    def __init__(self, path: Path):
        self.path = path
        self.how = None

    def __enter__(self) -> Path:
        if os.geteuid() != 0:
            os.chmod(self.path, 0o555)
            self.how = "chmod"
        elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(self.path)],
                                                       capture_output=True).returncode == 0:
            self.how = "chattr"
        else:
            pytest.skip("cannot make a read-only folder here (root without chattr)")
        return self.path

    def __exit__(self, *exc) -> None:
        if self.how == "chmod":
            os.chmod(self.path, 0o755)
        elif self.how == "chattr":
            subprocess.run(["chattr", "-i", str(self.path)], check=True)

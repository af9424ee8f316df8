"""Re-run a script's step under Nsight Compute (`ncu`) for `kprof profile --ncu`.

ncu replays each selected kernel launch ~10 times to collect its counters, so it measures one
step only: the child (`python -m kprof.capture.ncu`) runs the script unmodified through the
runner with the same warm-up, then opens an NVTX range `kprof.ncu` around one step
(RunConfig.on_step) and stops the script after it. ncu profiles only kernels launched inside that
range (`--nvtx --nvtx-include kprof.ncu/`: push/pop ranges take a trailing slash), and only the
selected kernel names (`--kernel-name regex:`, matched on the demangled name, the name Kineto's
trace records). The range is process-wide (`--nvtx-push-pop-scope process`) because backward
kernels are launched from autograd's own thread, where a thread-scoped range would not be open.

The report is written to a file (`--export`) and read back as CSV (`--import ... --csv --page
details`), so the script's own stdout never mixes with the table.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kprof.errors import KprofError

RANGE = "kprof.ncu"
HINT = ("ncu (Nsight Compute) is not on PATH: install it with the CUDA toolkit or from "
        "https://developer.nvidia.com/nsight-compute and put its folder on PATH to get hardware "
        "counters; continuing without them.")


def find_ncu() -> str | None:
    """Path of the `ncu` executable, or None."""
    return shutil.which("ncu")


def kernel_regex(names: list[str]) -> str:
    """One anchored alternation of the exact kernel names, for ncu's `--kernel-name regex:`."""
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def profile_command(ncu: str, report: str | os.PathLike, script: str, argv: list[str], names: list[str],
                    metrics: list[str], warmup: int) -> list[str]:
    """The ncu command line that measures one step of `script` (see the module docstring)."""
    return [ncu, "--target-processes", "all", "--nvtx", "--nvtx-push-pop-scope", "process",
            "--nvtx-include", f"{RANGE}/", "--kernel-name-base", "demangled",
            "--kernel-name", f"regex:{kernel_regex(names)}", "--metrics", ",".join(metrics),
            "--export", str(report), "--force-overwrite",
            sys.executable, "-m", "kprof.capture.ncu", "--warmup", str(warmup), script, "--", *argv]


def import_command(ncu: str, report: str | os.PathLike) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "details", "--print-units", "base"]


def run(ncu: str, script: str, argv: list[str], names: list[str], metrics: list[str], warmup: int,
        workdir: str | os.PathLike, timeout_s: float | None = None) -> str:
    """Measure the named kernels of one step under ncu; ncu's CSV (details page) as text. The
    script's output goes to this process's stderr. KprofError with the command when ncu fails."""
    report = Path(workdir) / "kprof-ncu"
    cmd = profile_command(ncu, report, script, argv, names, metrics, warmup)
    try:
        p = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise KprofError(f"ncu ran past {timeout_s:.0f} s; measure fewer kernels (--ncu-top)") from e
    rep = report.with_suffix(".ncu-rep")
    if p.returncode != 0 or not rep.is_file():
        raise KprofError(f"ncu exited with {p.returncode} and no report; run it by hand to see why: "
                         + " ".join(cmd))
    q = subprocess.run(import_command(ncu, rep), capture_output=True, text=True, check=False)
    if q.returncode != 0:
        raise KprofError(f"`ncu --import {rep}` failed ({q.returncode}): {q.stderr.strip()[:300]}")
    return q.stdout


def _child(args: list[str]) -> int:
    """`python -m kprof.capture.ncu --warmup W SCRIPT -- ARGS`: run SCRIPT with one step inside
    the NVTX range RANGE, then stop it."""
    from kprof.capture import nvtx
    from kprof.capture.runner import RunConfig, run_script

    warmup = int(args[args.index("--warmup") + 1]) if "--warmup" in args else 3
    rest = [a for i, a in enumerate(args) if a != "--warmup" and (i == 0 or args[i - 1] != "--warmup")]
    sep = rest.index("--") if "--" in rest else len(rest)
    script, argv = rest[0], rest[sep + 1:]

    def on_step(i: int) -> bool:
        if i == 0:
            nvtx.range_push(RANGE)
            return False
        nvtx.range_pop()
        return True  # one step measured: stop the script

    raw = run_script(script, argv, RunConfig(warmup=warmup, steps=1, on_step=on_step, record_shapes=False))
    return 0 if raw.status in ("completed", "stopped") else (raw.exit_code or 1)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))

"""`kprof profile --nproc-per-node N`: the script under torch's own elastic launcher
(`python -m torch.distributed.run --standalone`), each rank running `kprof profile` on itself.

Every rank records the same step window (the steps are counted per rank, and a data-parallel
job steps in lockstep), saves its run, and rank 0 merges them into one run
(kprof/analyze/profile.py, `_save_rank`). KPROF_GROUP names the launch, so that the ranks of
this launch, and only they, are merged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from kprof.errors import KprofError


def new_group() -> str:
    return f"kprof-{uuid.uuid4().hex[:12]}"


def torchrun_command(script: str, argv: list[str], nproc: int, kprof_args: list[str]) -> list[str]:
    """The command line: torchrun (as a module of this Python) running `kprof profile` per rank."""
    if nproc < 1:
        raise KprofError(f"--nproc-per-node must be at least 1 (got {nproc})", exit_code=2)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "kprof", "profile", script, *kprof_args, "--", *argv]


def launch(script: str, argv: list[str], nproc: int, kprof_args: list[str], group: str) -> int:
    """Run the job; the ranks' output goes to this terminal. Returns torchrun's exit code."""
    if "WORLD_SIZE" in os.environ:
        raise KprofError("--nproc-per-node inside a torchrun job: run `kprof profile SCRIPT` under your own "
                         "torchrun (each rank profiles itself and rank 0 merges), or --nproc-per-node "
                         "without torchrun", exit_code=2)
    env = dict(os.environ, KPROF_GROUP=group)
    try:
        return subprocess.call(torchrun_command(script, argv, nproc, kprof_args), env=env)
    except KeyboardInterrupt:
        return 130

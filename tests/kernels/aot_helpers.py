"""Ahead-of-time compiles for sm_90 from the CPU tests (imported by the test modules here).

The interpreter accepts code the compiler rejects (loop-carried type changes, int widths, inline
PTX it never runs) and never shows register pressure, so CPU CI also compiles the kernels for
sm_90 in a subprocess without TRITON_INTERPRET (ptxas ships with Triton).
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_aot_script(script: str, *args: str) -> str:
    """Run `script` (Python source) in a fresh interpreter without TRITON_INTERPRET; fail the
    test with its stderr if it fails; return its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout

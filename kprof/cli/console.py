"""The CLI's two consoles, in a module of their own so that kprof.cli.patch_cmds can use them
without importing the kprof.cli package (whose __init__ imports patch_cmds).

Rich sizes them from the terminal, or from $COLUMNS when it is set (read when the console is
made, else at each print); rendering reads `console.width`, never a fixed width.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, redirect_stdout
from typing import Iterator

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


@contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send everything written to stdout (the profiled script's prints, at the Python level and
    at file descriptor 1 for C extensions and child processes) to stderr, so that `--json`
    leaves exactly one JSON document on stdout."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # captured stdout (tests): no descriptor to move
        fd = err_fd = None
    saved = os.dup(fd) if fd is not None else None
    if saved is not None:
        os.dup2(err_fd, fd)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, fd)
            os.close(saved)

"""The data types and run helpers every diagnosis uses (kept apart from the package's __init__,
which imports the diagnosis modules)."""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from kprof.analyze.modules import is_gpu_run, step_ms  # noqa: F401  (re-exported for the diagnoses)


@dataclass
class Finding:
    """One diagnosed problem with its evidence and the change that fixes it."""

    where: str  # what the user looks at: "train.py:21", "12 fp32 matmuls", "optimizer AdamW (for-loop)"
    evidence: str  # what in the profile shows it, in words and numbers
    change: str  # the fix, in words
    how: str  # the exact edit ("torch.optim.AdamW(..., fused=True)")
    ms_per_step: float = math.nan  # measured time of the evidence, per step (nan: not a time)
    saving_ms: float = math.nan  # estimated saving per step (nan: can't be estimated from this run)
    saving_note: str = ""  # how the saving was estimated, or why there is none
    source: str = ""  # file:line in the user's script, if known
    paths: list[str] = field(default_factory=list)  # sites / module paths, for --json
    cls: str = ""  # what kind of time the evidence is ("host sync", "compute-bound", ...)
    confidence: str = "medium"  # high | medium | low: how sure the profile shows this problem
    details: list[dict] = field(default_factory=list)  # per-site records for --json
    # The exact change (kprof.rules.edits): {"file", "line", "unified_diff", "reason"}; None: no
    # builder ran, which diagnose() reports as such.
    diff: dict | None = None
    applyable: bool = False  # `kprof apply --patch <diagnosis id>` installs it on the live run


@dataclass(frozen=True)
class Diagnosis:
    """One problem class -> its finder. `find` is pure: (ops.parquet, summary.json) -> findings."""

    id: str
    title: str
    find: Callable[[pd.DataFrame, dict], list[Finding]]


def n_steps(ops: pd.DataFrame, summary: dict) -> int:
    n = summary.get("steps_recorded")
    if not n and ops is not None and "step" in ops and len(ops):
        n = ops["step"].nunique()
    return max(int(n or 1), 1)


def parse_script(script: str | None) -> tuple[str, ast.Module] | None:
    """(text, ast) of the user's script, for diagnoses that point at a line of it (nothing is run);
    None when there is no readable, parseable script."""
    if not script or not Path(script).is_file():
        return None
    try:
        text = Path(script).read_text()
        return text, ast.parse(text, filename=script)
    except (SyntaxError, OSError, UnicodeDecodeError, ValueError):
        return None


def site(source: str) -> tuple[str, int] | None:
    """"path/train.py:42" -> ("path/train.py", 42); None when there is no line."""
    path, _, line = (source or "").rpartition(":")
    return (path, int(line)) if path and line.isdigit() else None

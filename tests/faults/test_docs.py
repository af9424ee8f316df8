"""docs/faults.md is the fault list of tests/faults/faultkit.py, and every fault in it is
planted by a test here, one the default run keeps (not `slow`): the table cannot drift from what
the suite checks.
`KPROF_UPDATE_SNAPSHOTS=1 python -m pytest tests/faults/test_docs.py` rewrites the table."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from faultkit import FAULTS, REPO

DOC = REPO / "docs" / "faults.md"
HEAD = """# Faults kprof is tested against

Each row is a fault planted by the fault suite (`tests/faults/`, CPU, run by CI), what kprof
says (a phrase of its one-line error or warning) and its exit code. Every planted fault also
checks that kprof prints no traceback of its own, that the user's files are byte-identical
afterwards, that the other runs still load, and that partial results are kept and marked. The
table is generated from `tests/faults/faultkit.py` (`FAULTS`), and `tests/faults/test_docs.py`
fails when the two differ. Exit codes: 0 ok; 1 the user's script failed; 2 bad input to
kprof; 3 a patch failed verification under `--strict`, or the patched run's loss diverged;
130 interrupted (Ctrl-C or SIGTERM). Divergence is |d loss| over 10x the spread of two
unpatched runs; docs/results.md has its check on the H200 against a planted drifting kernel.

| fault | kprof says | exit code |
|---|---|---|
"""


def table() -> str:
    rows = [f"| {f.fault} | {f.says if f.says.startswith('(') else '`' + f.says + '`'} | {f.code} |"
            for f in FAULTS.values()]
    return HEAD + "\n".join(rows) + "\n"


def test_docs_table_is_the_fault_list():
    want = table()
    if os.environ.get("KPROF_UPDATE_SNAPSHOTS") == "1":
        DOC.write_text(want)
    assert DOC.read_text() == want, "docs/faults.md is stale: KPROF_UPDATE_SNAPSHOTS=1 rewrites it"


def test_every_fault_is_planted():
    assert len(FAULTS) >= 25
    here = Path(__file__).parent
    text = "\n".join(p.read_text() for p in here.glob("test_*.py") if p.name != Path(__file__).name)
    planted = set(re.findall(r'"([a-z0-9_]+)"', text))
    assert not set(FAULTS) - planted, f"faults with no test: {sorted(set(FAULTS) - planted)}"


def _slow(node: ast.expr) -> bool:
    """`pytest.mark.slow` (or a name bound to it, `slow`), as a decorator or in a param's marks."""
    return any((isinstance(n, ast.Attribute) and n.attr == "slow") or (isinstance(n, ast.Name) and n.id == "slow")
               for n in ast.walk(node))


def _fast_strings(source: str) -> set[str]:
    """The string constants of the test functions in `source` that the default run keeps: not
    marked slow, and outside the `pytest.param(..., marks=slow)` cases of their parametrize."""
    out: set[str] = set()
    for fn in ast.parse(source).body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
            continue
        if any(_slow(d) and not (isinstance(d, ast.Call) and "parametrize" in ast.unparse(d.func))
               for d in fn.decorator_list):
            continue
        slow_params = {id(n) for d in fn.decorator_list for c in ast.walk(d)
                       if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("param")
                       and any(k.arg == "marks" and _slow(k.value) for k in c.keywords)
                       for n in ast.walk(c)}
        out |= {n.value for n in ast.walk(fn)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in slow_params}
    return out


def test_every_fault_is_planted_by_a_fast_test():
    # the default run (`-m 'not slow'`) plants every fault once: slow cases only add to that
    here = Path(__file__).parent
    fast = set().union(*(_fast_strings(p.read_text()) for p in here.glob("test_*.py") if p.name != Path(__file__).name))
    assert not set(FAULTS) - fast, f"faults planted only by slow tests: {sorted(set(FAULTS) - fast)}"

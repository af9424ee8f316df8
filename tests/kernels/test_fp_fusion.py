"""Every Triton launch in kprof's kernel library pins FP fusion on (`common.FP_FUSION`).

Triton 3.10 turns fusion off by default; measured on the H200, that costs the erf
bias+GELU 12% and LayerNorm's fwd+bwd 21% (see `common.FP_FUSION`). A launch that forgets the
option would silently change speed and rounding with the user's Triton version, so this test
finds each launch (`name[grid](...)` or `launch(name, grid, ...)`) in the kernel modules and checks its arguments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _pins(call: ast.Call) -> bool:
    return any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "FP_FUSION" for k in call.keywords)


def _launches(path: Path):
    """(line, has **FP_FUSION) of each launch: a call whose callee is a subscript `x[grid]`, or
    `launch(x, grid, ...)` (kernels/common.py). Inside `common.launch` itself the subscript calls
    forward the caller's keywords, which the caller's `launch(...)` line is checked for."""
    tree = ast.parse(path.read_text())
    forwarding: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "launch" and path.name == "common.py":
            forwarding |= {id(n) for n in ast.walk(fn)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in forwarding:
            continue
        if isinstance(node.func, ast.Subscript) or (isinstance(node.func, ast.Name) and node.func.id == "launch"):
            yield node.lineno, _pins(node)


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_every_launch_pins_fp_fusion(path):
    missing = [line for line, ok in _launches(path) if not ok]
    assert not missing, f"{path.name}: Triton launches without **FP_FUSION at lines {missing}"


def test_the_library_launches_kernels_at_all():
    # Guards the test above against a pattern that matches nothing.
    assert sum(1 for p in KERNELS.glob("*.py") for _ in _launches(p)) >= 16


def test_fp_fusion_is_a_launch_option():
    from kprof.kernels.common import FP_FUSION

    assert FP_FUSION == {"enable_fp_fusion": True}

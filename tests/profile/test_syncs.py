"""kprof.capture.syncs.SyncDetector: which calls count as host syncs, and which line gets the blame.

The detector treats this test file as "the user's script" (its folder is the user's code), so
each sync below must be attributed to the line of this file that made it.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np  # noqa: F401  (used by the eval'd statements)
import pytest
import torch
from torch.overrides import TorchFunctionMode

from kprof.capture.syncs import SyncDetector


@pytest.fixture
def detector():
    # cuda_run=False: a CPU-only run, which reports what would sync on a GPU.
    d = SyncDetector(__file__, cuda_run=False)
    d.install()
    d.step = 0
    try:
        yield d
    finally:
        d.uninstall()
    assert torch._C._len_torch_function_stack() == 0


def here() -> int:
    return sys._getframe(1).f_lineno


def only_site(d: SyncDetector) -> dict:
    rows = d.summary()
    assert len(rows) == 1, rows
    return rows[0]


v = torch.tensor([1.0, -2.0, 3.0, -4.0])
m = v > 0
t = v.sum()

# Each case: a statement that syncs on a GPU, and the kind it is reported as.
SYNCS = [
    ("t.item()", "Tensor.item"),
    ("v.tolist()", "Tensor.tolist"),
    ("v.numpy()", "Tensor.numpy"),
    ("np.asarray(v)", "Tensor.__array__ (numpy conversion)"),
    ("v.cpu()", "Tensor.cpu"),
    ("str(v)", "Tensor.__repr__ (print/str of a tensor)"),
    ("f'{t:.3f}'", "Tensor.__format__ (f-string/format of a tensor)"),
    ("bool(t)", "Tensor.__bool__ (if tensor / bool(tensor))"),
    ("(1 if t else 0)", "Tensor.__bool__ (if tensor / bool(tensor))"),
    ("float(t)", "Tensor.__float__"),
    ("int(t)", "Tensor.__int__"),
    ("3.0 in v", "Tensor.__contains__ (x in tensor)"),
    ("torch.equal(v, v)", "torch.equal"),
    ("torch.allclose(v, v)", "torch.allclose"),
    ("torch.nonzero(v)", "torch.nonzero (data-dependent shape)"),
    ("v.nonzero()", "Tensor.nonzero (data-dependent shape)"),
    ("torch.masked_select(v, m)", "torch.masked_select (data-dependent shape)"),
    ("torch.unique(v)", "torch.unique (data-dependent shape)"),
    ("v.unique()", "Tensor.unique (data-dependent shape)"),
    ("v[m]", "Tensor.__getitem__[bool mask] (data-dependent shape)"),
    ("torch.where(m)", "torch.where(cond) (data-dependent shape)"),
    ("torch.repeat_interleave(v, torch.tensor([1, 2, 1, 1]))", "repeat_interleave(tensor repeats) (data-dependent shape)"),
    ("torch.bincount(torch.tensor([0, 2, 2]))", "torch.bincount (data-dependent shape)"),
]

# Statements that never wait for the device.
NOT_SYNCS = [
    "v + 1",
    "v.sum()",
    "v[0]",
    "v[1:3]",
    "torch.where(m, v, 0.0)",
    "v.repeat_interleave(2)",
    "torch.repeat_interleave(v, torch.tensor([1, 2, 1, 1]), output_size=5)",
    "v.to(torch.float64)",
    "v.masked_fill(m, 0.0)",
    # On a CPU run `.to(device)` resolves to "cpu" too; moving data there is not a read-back.
    "v.to('cpu')",
]


@pytest.mark.parametrize("stmt, kind", SYNCS, ids=[s for s, _ in SYNCS])
def test_sync_is_reported_at_the_calling_line(detector, stmt, kind):
    line = here(); eval(stmt)  # noqa: E702  (same line: the eval frame's caller is this line)
    site = only_site(detector)
    assert site["kind"] == kind
    # eval() runs in a "<string>" frame; the innermost frame in the user's file is this one.
    assert site["file"] == __file__ and site["line"] == line
    assert site["function"] == "test_sync_is_reported_at_the_calling_line"
    assert "eval(stmt)" in site["code"]
    assert site["count"] == 1 and site["steps"] == [0]
    assert site["would_sync_on_gpu"] is True and site["real"] is False


@pytest.mark.parametrize("stmt", NOT_SYNCS)
def test_non_syncing_calls_are_not_reported(detector, stmt):
    eval(stmt)
    assert detector.summary() == []


def test_print_and_masked_assignment(detector, capsys):
    x = v.clone()
    print(x); line_print = here()  # noqa: E702
    x[m] = 0.0  # a scalar: ATen turns this into masked_fill_, no sync
    x[m] = v[m] * 2; line_assign = here()  # noqa: E702
    assert "tensor(" in capsys.readouterr().out
    got = {(s["kind"], s["line"]) for s in detector.summary()}
    assert got == {
        ("Tensor.__repr__ (print/str of a tensor)", line_print),
        ("Tensor.__getitem__[bool mask] (data-dependent shape)", line_assign),
        ("Tensor.__setitem__[bool mask] (data-dependent shape)", line_assign),
    }


def test_counts_aggregate_by_site_and_remember_steps(detector):
    for step in range(3):
        detector.step = step
        for _ in range(2):
            t.item(); line = here()  # noqa: E702
    detector.step = None
    t.item()  # outside a recorded step: ignored
    site = only_site(detector)
    assert site["line"] == line and site["count"] == 6 and site["steps"] == [0, 1, 2]


def test_torch_internal_reads_are_not_blamed_on_a_cpu_run(detector):
    # AdamW calls .item() on its host-side step counter; on a GPU that is no device sync.
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    assert detector.summary() == []


def test_library_frames_are_skipped_and_named_in_via(detector, tmp_path):
    lib = tmp_path / "somelib.py"
    lib.write_text("def read(x):\n    return x.item()\n")
    spec = importlib.util.spec_from_file_location("somelib_for_kprof_test", lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.read(t); line = here()  # noqa: E702
    site = only_site(detector)
    assert site["file"] == __file__ and site["line"] == line
    assert site["via"] == f"{lib}:2"


def test_cuda_run_ignores_host_tensors():
    # On a GPU run only tensors on the device count: .item() of a CPU tensor costs no sync.
    d = SyncDetector(__file__, cuda_run=True)
    d.install()
    d.step = 0
    try:
        t.item()
        v.cpu()
        v[m]
    finally:
        d.uninstall()
    assert d.summary() == []


def test_cuda_synchronize_is_patched_only_while_installed():
    orig = torch.cuda.synchronize
    d = SyncDetector(__file__, cuda_run=torch.cuda.is_available())
    d.install()
    d.step = 0
    try:
        assert torch.cuda.synchronize is not orig
        try:
            line = here(); torch.cuda.synchronize()  # noqa: E702
        except (AssertionError, RuntimeError):  # CPU-only torch: the real call refuses
            pass
    finally:
        d.uninstall()
    assert torch.cuda.synchronize is orig
    site = only_site(d)
    assert site["kind"] == "torch.cuda.synchronize" and site["line"] == line


def test_uninstall_with_another_mode_pushed_above():
    class Other(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    d = SyncDetector(__file__, cuda_run=False)
    d.install()
    other = Other()
    other.__enter__()  # e.g. a `with torch.device(...)` opened inside a step, closed later
    d.uninstall()
    assert torch._C._len_torch_function_stack() == 1
    other.__exit__(None, None, None)  # pops `other`, not kprof's mode
    assert torch._C._len_torch_function_stack() == 0


def test_a_failing_check_does_not_change_behaviour(detector):
    # Tensor.to with arguments torch cannot parse: the check gives up, torch raises as usual.
    with pytest.raises(TypeError):
        v.to(object())
    assert detector.summary() == []

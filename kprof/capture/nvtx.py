"""NVTX ranges, so Nsight Systems shows the same module names as kprof's own trace.

Backends, first that works: the `nvtx` package (NVIDIA's, a pip install; its push/pop are no-ops
costing well under a microsecond when no Nsight tool is attached), else `torch.cuda.nvtx`
(needs a CUDA build of torch with a GPU), else nothing. The GPU image has no `nvtx` package,
so the torch fallback is the one used there. Importing this module never fails.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def _noop_push(name: str) -> None:
    return None


def _noop_pop() -> None:
    return None


def _pick_backend() -> tuple[str, Callable[[str], object], Callable[[], object]]:
    try:
        import nvtx as _nvtx_pkg  # NVIDIA's package; optional

        # Probe once: an old or broken install must not break every module forward later.
        _nvtx_pkg.push_range("kprof.capture.nvtx.probe")
        _nvtx_pkg.pop_range()
        return "nvtx", lambda name: _nvtx_pkg.push_range(name), _nvtx_pkg.pop_range
    except Exception:
        pass
    try:
        if torch.cuda.is_available():
            from torch.cuda import nvtx as _torch_nvtx

            return "torch.cuda.nvtx", _torch_nvtx.range_push, _torch_nvtx.range_pop
    except Exception:
        pass
    return "none", _noop_push, _noop_pop


BACKEND, _push, _pop = _pick_backend()


def range_push(name: str) -> None:
    """Open a nested NVTX range on the calling thread."""
    _push(name)


def range_pop() -> None:
    """Close the innermost NVTX range opened on the calling thread."""
    _pop()


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """`with annotate("model.layers.0 (Block)"): ...` marks the block in Nsight."""
    _push(name)
    try:
        yield
    finally:
        _pop()
